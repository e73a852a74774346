"""The OpenAI-compatible answering proxy (opt-in): search on the last user message, put the context into
the conversation, forward to the answer LLM, return (or stream) its completion.

The last user message is replaced by the configured template filled with `$context` and `$question`; the
rest of the request goes to the answer LLM as it came, with the configured model. A bad request is a 4xx,
the retriever down a 503, the answer LLM failing a 502 / 504 (after the first streamed chunk: an `error`
event, then the stream ends).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from string import Template
from typing import Any, Protocol

import orjson
from pydantic import ValidationError

from services.common import sse
from services.common.admission import Caller
from services.common.errors import BadRequest, ServiceError
from services.common.schemas.chat import ChatCompletionRequest, ChatMessageIn, SearchSummary
from services.common.schemas.searcher import MAX_QUESTION_CHARS, SearchRequest
from services.searcher.serving import SearchService
from services.searcher.settings import ChatProxySettings

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


class AnswerBackend(Protocol):
    """What the proxy needs of the answer LLM (`OpenAIChatClient` has it)."""

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def stream(self, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]: ...


def event(data: dict[str, Any]) -> bytes:
    return sse.encode(orjson.dumps(data))


def last_user_index(messages: list[ChatMessageIn]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].role == "user":
            return i
    raise BadRequest("the conversation has no user message to search for", param="messages")


def augment(messages: list[ChatMessageIn], index: int, text: str) -> list[dict[str, Any]]:
    """The messages as dicts, with message `index`'s text replaced by `text` (non-text parts kept)."""
    out = [m.model_dump(exclude_none=True) for m in messages]
    content = messages[index].content
    if isinstance(content, list):
        out[index]["content"] = [{"type": "text", "text": text}] + [
            p.model_dump(exclude_none=True) for p in content if p.type != "text"]
    else:
        out[index]["content"] = text
    return out


class ChatProxy:
    def __init__(self, search: SearchService, answer: AnswerBackend, settings: ChatProxySettings) -> None:
        self.search = search
        self.answer = answer
        self.settings = settings
        self.template = Template(settings.template)

    async def prepare(self, request: ChatCompletionRequest, caller: Caller | None = None
                      ) -> tuple[dict[str, Any], SearchSummary]:
        """Search, and the request body for the answer LLM."""
        index = last_user_index(request.messages)
        question = request.messages[index].text()
        if not question.strip():
            raise BadRequest("the last user message has no text to search for", param="messages")
        options = request.search.model_dump(exclude_none=True) if request.search is not None else {}
        options.setdefault("mode", self.settings.mode)
        try:
            search_request = SearchRequest(question=question.strip()[:MAX_QUESTION_CHARS], **options)
        except ValidationError as exc:
            errors = exc.errors()
            raise BadRequest(f"search options: {errors[0].get('msg', 'invalid') if errors else 'invalid'}",
                             param="search") from exc
        found = await self.search.search(search_request, caller)
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        if found.documents:
            messages = augment(request.messages, index, self.template.substitute(
                context=found.context, question=question))
        body = request.model_dump(exclude={"search", "stream", "messages"}, exclude_none=True)
        body.update(messages=messages, model=self.settings.answer.model)
        return body, SearchSummary(mode=found.mode, queries=found.queries, cached=found.cached,
                                   document_ids=[d.id for d in found.documents],
                                   titles=[d.title for d in found.documents], degraded=found.degraded)

    async def complete(self, request: ChatCompletionRequest, caller: Caller | None = None) -> dict[str, Any]:
        body, summary = await self.prepare(request, caller)
        completion = await self.answer.complete(body)
        completion["search"] = summary.model_dump(mode="json")
        return completion

    async def open_stream(self, request: ChatCompletionRequest, caller: Caller | None = None
                          ) -> AsyncGenerator[bytes, None]:
        """Search and wait for the first chunk (so that failures up to there answer with their status),
        then the server-sent events of the rest; the first chunk carries `search`."""
        body, summary = await self.prepare(request, caller)
        chunks = self.answer.stream(body)
        try:
            first: dict[str, Any] | None = await anext(chunks)
        except StopAsyncIteration:
            first = None
        except BaseException:
            await chunks.aclose()
            raise
        return self._events(first, chunks, summary)

    async def _events(self, first: dict[str, Any] | None, chunks: AsyncGenerator[dict[str, Any], None],
                      summary: SearchSummary) -> AsyncGenerator[bytes, None]:
        async with aclosing(chunks):
            if first is not None:
                yield event({**first, "search": summary.model_dump(mode="json")})
                try:
                    async for chunk in chunks:
                        yield event(chunk)
                except ServiceError as exc:
                    logger.warning("answer stream failed after it began: %s", exc.message)
                    yield event({"error": {"type": exc.type, "message": exc.message}})
            yield DONE
