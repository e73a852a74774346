"""The OpenAI-compatible answering proxy (opt-in): search on the last user message, put the context into
the conversation, forward to the answer LLM, return (or stream) its completion.

The last user message is replaced by the configured template filled with `$context` and `$question`; the
rest of the request goes to the answer LLM as it came, with the configured model. A bad request is a 4xx,
the retriever down a 503, the answer LLM failing a 502 / 504 (after the first streamed chunk: an `error`
event, then the stream ends).

What a request makes the LLMs do is charged to its caller before anything starts: the answer's tokens are
bounded (`max_tokens`: the settings' default when unset, at most `max_tokens_limit`; `min_tokens` at most
that), its cost (`answer_cost`) is added to the search's for the per-request bound and the key's budget,
and the request holds one of the LLM's slots (`SearchService.take_llm_slots`) from search to last token.
The answer is always asked of the LLM as a stream, so a caller that leaves stops the generation.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from string import Template
from typing import Any, Protocol

import orjson
from pydantic import ValidationError

from services.common import sse
from services.common.admission import Caller
from services.common.errors import BadRequest, CostLimitExceeded, ServiceError
from services.common.schemas.chat import ChatCompletionRequest, ChatMessageIn, SearchSummary
from services.common.schemas.searcher import MAX_QUESTION_CHARS, SearchRequest
from services.searcher.serving import SearchService
from services.searcher.settings import ChatProxySettings

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"

ANSWER_TOKENS_PER_UNIT = 160
"""Cost units are sized on one policy-LLM call of the default search (`search_cost`), which generates at
most 160 tokens: an answer costs one unit per 160 tokens it may generate..."""
PROMPT_CHARS_PER_UNIT = 4_000
"""... plus one for reading the search's documents, and one per 4,000 characters (~1,000 tokens) of the
caller's own messages."""


def answer_cost(max_tokens: int, message_chars: int) -> float:
    """Cost units of one answer (see the constants): max_tokens 256 and a short question: 2.6."""
    return 1.0 + max_tokens / ANSWER_TOKENS_PER_UNIT + message_chars / PROMPT_CHARS_PER_UNIT


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

    def max_tokens(self, request: ChatCompletionRequest) -> int:
        """The answer's token bound: the request's (`max_tokens` or `max_completion_tokens`, the lower),
        else the settings' default; over `max_tokens_limit`, or a `min_tokens` over it, is refused."""
        asked = [t for t in (request.max_tokens, request.max_completion_tokens) if t is not None]
        tokens = min(asked) if asked else self.settings.max_tokens
        limit = self.settings.max_tokens_limit
        if tokens > limit:
            raise CostLimitExceeded(f"max_tokens {tokens} is over this proxy's limit of {limit} answer tokens",
                                    param="max_tokens")
        if request.min_tokens is not None and request.min_tokens > tokens:
            raise CostLimitExceeded(f"min_tokens {request.min_tokens} is over the request's max_tokens ({tokens})",
                                    param="min_tokens")
        return tokens

    def cost(self, request: ChatCompletionRequest) -> float:
        """The request's cost units, search and answer (for the guard's admission; bad input raises)."""
        search_request = self._search_request(request)[1]
        return self.search.cost([search_request]) + self._answer_cost(request)

    def _answer_cost(self, request: ChatCompletionRequest) -> float:
        return answer_cost(self.max_tokens(request), sum(len(m.text()) for m in request.messages))

    def _search_request(self, request: ChatCompletionRequest) -> tuple[int, SearchRequest]:
        index = last_user_index(request.messages)
        question = request.messages[index].text()
        if not question.strip():
            raise BadRequest("the last user message has no text to search for", param="messages")
        options = request.search.model_dump(exclude_none=True) if request.search is not None else {}
        options.setdefault("mode", self.settings.mode)
        try:
            return index, SearchRequest(question=question.strip()[:MAX_QUESTION_CHARS], **options)
        except ValidationError as exc:
            errors = exc.errors()
            first: dict[str, Any] = dict(errors[0]) if errors else {}
            if tuple(first.get("loc", ()))[:1] == ("question",):  # the message's text, not a search option
                raise BadRequest(f"the last user message: {first.get('msg', 'invalid')}",
                                 param=f"messages.{index}.content") from exc
            raise BadRequest(f"search options: {first.get('msg', 'invalid')}", param="search") from exc

    async def prepare(self, request: ChatCompletionRequest, caller: Caller | None = None
                      ) -> tuple[dict[str, Any], SearchSummary]:
        """Search (charging the caller for search and answer), and the request body for the answer LLM."""
        index, search_request = self._search_request(request)
        max_tokens = self.max_tokens(request)
        found = await self.search.search(search_request, caller, extra_cost=self._answer_cost(request),
                                         hold_llm=False)
        question = request.messages[index].text()
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        if found.documents:
            messages = augment(request.messages, index, self.template.substitute(
                context=found.context, question=question))
        body = request.model_dump(exclude={"search", "stream", "messages", "max_completion_tokens"},
                                  exclude_none=True)
        body.update(messages=messages, model=self.settings.answer.model, max_tokens=max_tokens)
        return body, SearchSummary(mode=found.mode, queries=found.queries, cached=found.cached,
                                   document_ids=[d.id for d in found.documents],
                                   titles=[d.title for d in found.documents], degraded=found.degraded)

    async def complete(self, request: ChatCompletionRequest, caller: Caller | None = None) -> dict[str, Any]:
        release = self.search.take_llm_slots(caller)
        try:
            body, summary = await self.prepare(request, caller)
            completion = await self.answer.complete(body)
        finally:
            release()
        completion["search"] = summary.model_dump(mode="json")
        return completion

    async def open_stream(self, request: ChatCompletionRequest, caller: Caller | None = None
                          ) -> AsyncGenerator[bytes, None]:
        """Search and wait for the first chunk (so that failures up to there answer with their status),
        then the server-sent events of the rest; the first chunk carries `search`."""
        release = self.search.take_llm_slots(caller)
        try:
            body, summary = await self.prepare(request, caller)
            chunks = self.answer.stream(body)
            try:
                first: dict[str, Any] | None = await anext(chunks)
            except StopAsyncIteration:
                first = None
            except BaseException:
                await chunks.aclose()
                raise
        except BaseException:
            release()
            raise
        return self._events(first, chunks, summary, release)

    async def _events(self, first: dict[str, Any] | None, chunks: AsyncGenerator[dict[str, Any], None],
                      summary: SearchSummary, release: Callable[[], None]) -> AsyncGenerator[bytes, None]:
        try:
            async with aclosing(chunks):
                if first is not None:
                    yield event({**first, "search": summary.model_dump(mode="json")})
                    try:
                        async for chunk in chunks:
                            yield event(chunk)
                    except ServiceError as exc:
                        logger.warning("answer stream failed after it began: %s", exc.message)
                        yield event({"error": {"type": exc.type, "message": exc.message}})
        finally:
            release()  # the LLM is done with this request (or the caller left: closing stopped it)
        yield DONE
