"""Server-sent events (the `text/event-stream` format) both ways: encoding on the services, decoding in the
clients (the streaming response that sends them is `plugsearch.common.app.EventStreamResponse`; this module
needs nothing beyond the standard library, so the public client can read a stream).

    event: retrieval            <- optional event name (default: "message")
    data: {"turn": 1, ...}      <- one JSON document per event
                                <- a blank line ends the event
    : keep-alive                <- a comment line, ignored by readers
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Mapping

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
