"""Server-sent events (the `text/event-stream` format) both ways: encoding on the services, decoding in the
clients, and a streaming response that always closes its event source.

    event: retrieval            <- optional event name (default: "message")
    data: {"turn": 1, ...}      <- one JSON document per event
                                <- a blank line ends the event
    : keep-alive                <- a comment line, ignored by readers
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Mapping

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

MEDIA_TYPE = "text/event-stream"
HEADERS: Mapping[str, str] = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""No caching, and no buffering in proxies (nginx reads `X-Accel-Buffering`)."""
KEEP_ALIVE = b": keep-alive\n\n"


def encode(data: bytes, event: str | None = None) -> bytes:
    """One event: `data` must be one line (compact JSON is)."""
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + data + b"\n\n"


async def parse(lines: AsyncIterable[str]) -> AsyncIterator[tuple[str, str]]:
    """(event name, data) per event of a stream read line by line (line endings already stripped);
    comments and fields other than `event` and `data` are skipped, several `data` lines are joined."""
    name, data = "", list[str]()
    async for line in lines:
        if not line:
            if data:
                yield name or "message", "\n".join(data)
            name, data = "", []
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            name = value
        elif field == "data":
            data.append(value)
    if data:
        yield name or "message", "\n".join(data)


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response over an async generator that is closed when the response ends for
    any reason (a client that went away included), so whatever work the generator owns stops with it."""

    def __init__(self, events: AsyncGenerator[bytes, None], headers: Mapping[str, str] | None = None) -> None:
        super().__init__(events, media_type=MEDIA_TYPE, headers={**HEADERS, **(headers or {})})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
