"""The OpenAI-compatible answering proxy (opt-in): search on the last user message, put the context into
the conversation, forward to the answer LLM, return (or stream) its completion.

The request's fields are an allow-list (`plugsearch.common.schemas.chat`): backend extensions pass only when
the settings name them (`ChatProxySettings.extensions`), anything else is refused before any work. The last
user message is replaced by the configured template filled with `$context` and `$question`; the checked
fields go on to the answer LLM, with the configured model. A bad request is a 4xx (a parameter the answer LLM
refuses with a 4xx: 422), the retriever down a 503, the answer LLM failing a 502 / 504; a stream that breaks
off or ends without finishing (no `[DONE]`, the backend's error event, no finish reason) ends with an `error`
event, a non-streamed answer with the error envelope: never a silent success.

What a request makes the LLMs do is charged to its caller before anything starts, and bounded: the answer's
tokens (`max_tokens`: the settings' default when unset, at most `max_tokens_limit`; `min_tokens` at most
that), the caller's messages (`max_prompt_chars`, refused over it) and the documents pasted in
(`max_context_chars`, cut to it). Its cost (`answer_cost`) is added to the search's for the per-request bound
and the key's budget, and the request holds one of the LLM's slots (`SearchAdmission.take_llm_slots`: waiting
for its turn among keys while they are all held) from search to last token. A request is checked and priced
once (`ChatProxy.prepare`, its search by `SearchService.prepare`). The answer is always asked of the
LLM as a stream, so a caller that leaves stops the generation and gives its slot back at once.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from string import Template
from typing import Any, NamedTuple, Protocol

import orjson
from pydantic import ValidationError

from plugsearch.common import sse
from plugsearch.common.admission import Caller
from plugsearch.common.errors import (
    BadRequest,
    CostLimitExceeded,
    ServiceError,
    UpstreamError,
    ValidationFailed,
)
from plugsearch.common.schemas.base import Document
from plugsearch.common.schemas.chat import (
    EXTENSIONS,
    ChatCompletionRequest,
    ChatMessageIn,
    SearchSummary,
    TextPart,
)
from plugsearch.common.schemas.searcher import MAX_QUESTION_CHARS, SearchRequest
from plugsearch.searcher import parsing
from plugsearch.searcher.serving import PreparedSearch, SearchService
from plugsearch.searcher.settings import ChatProxySettings

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"

ANSWER_TOKENS_PER_UNIT = 160
"""Cost units are sized on one policy-LLM call of the default search (`search_cost`), which generates at
most 160 tokens: an answer costs one unit per 160 tokens it may generate..."""
PROMPT_CHARS_PER_UNIT = 4_000
"""... plus one per 4,000 characters (~1,000 tokens) of the prompt it may read: the caller's messages and the
documents pasted in (`max_context_chars`, charged in full: what the search finds is not known yet)."""

NOT_FORWARDED = {"search", "stream", "stream_options", "messages", "max_completion_tokens", "logprobs"}
"""Request fields the proxy uses itself (the rest of the allow-list goes to the answer LLM as it came)."""


def answer_cost(max_tokens: int, prompt_chars: int) -> float:
    """Cost units of one answer (see the constants): max_tokens 256 and a short question beside 8,000
    characters of documents: 3.6."""
    return max_tokens / ANSWER_TOKENS_PER_UNIT + prompt_chars / PROMPT_CHARS_PER_UNIT


def prompt_chars(request: ChatCompletionRequest) -> int:
    """The characters of the caller's own prompt: its messages' text and its tool definitions."""
    tools = len(orjson.dumps([t.model_dump(exclude_none=True) for t in request.tools])) if request.tools else 0
    return sum(len(m.text()) for m in request.messages) + tools


def fit_context(documents: Sequence[Document], max_chars: int) -> tuple[str, int]:
    """The documents as the context block, at most `max_chars` characters: whole documents in order while they
    fit (the first one cut when it alone does not); returns the block and how many documents it holds."""
    used, block = 0, ""
    for i in range(1, len(documents) + 1):
        longer = parsing.format_documents(documents[:i])
        if len(longer) > max_chars:
            break
        used, block = i, longer
    if used == 0 and documents:
        overhead = len(parsing.format_documents([documents[0].model_copy(update={"text": ""})])) + 4
        block = parsing.format_documents(documents[:1], max_chars=max(1, max_chars - overhead))[:max_chars]
        used = 1
    return block, used


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
            p.model_dump(exclude_none=True) for p in content if not isinstance(p, TextPart)]
    else:
        out[index]["content"] = text
    return out


class PreparedChat(NamedTuple):
    """A chat request checked and priced once (`ChatProxy.prepare`)."""

    request: ChatCompletionRequest
    search: PreparedSearch
    """The search of its last user message (`message`: where it is in `request.messages`)."""
    message: int
    max_tokens: int
    answer_cost: float

    @property
    def cost(self) -> float:
        """Its cost units, search and answer (the guard's admission, the per-request bound, the budget)."""
        return self.search.cost + self.answer_cost


class ChatProxy:
    def __init__(self, search: SearchService, answer: AnswerBackend, settings: ChatProxySettings) -> None:
        self.search = search
        self.answer = answer
        self.settings = settings
        self.template = Template(settings.template)

    def check(self, request: ChatCompletionRequest) -> None:
        """What the schema cannot know: the backend extensions this proxy forwards, and the prompt's bound."""
        for name in request.extensions_used():
            if name not in self.settings.extensions:
                fields = [f for f in EXTENSIONS[name] if getattr(request, f) is not None]
                raise ValidationFailed(
                    f"{'image content parts are' if name == 'image_url' else ', '.join(fields) + ' is'} a backend "
                    f"extension this proxy does not forward (the operator may allow it: SEARCHER_CHAT__EXTENSIONS)",
                    param=fields[0] if fields else "messages")
        chars, limit = prompt_chars(request), self.settings.max_prompt_chars
        if chars > limit:
            raise CostLimitExceeded(f"the messages are {chars} characters, over this proxy's limit of {limit} "
                                    "(shorten the conversation)", param="messages")

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

    async def prepare(self, request: ChatCompletionRequest) -> PreparedChat:
        """The request checked (bad input raises, before any work), its search prepared, its answer priced."""
        self.check(request)
        index, search_request = self._search_request(request)
        search = await self.search.prepare(search_request)
        max_tokens = self.max_tokens(request)
        return PreparedChat(request, search, index, max_tokens,
                            answer_cost(max_tokens, prompt_chars(request) + self.settings.max_context_chars))

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

    async def _searched(self, prepared: PreparedChat, caller: Caller | None = None
                        ) -> tuple[dict[str, Any], SearchSummary]:
        """Search (charging the caller for search and answer), and the request body for the answer LLM."""
        request, index, max_tokens = prepared.request, prepared.message, prepared.max_tokens
        found = await self.search.search(prepared.search, caller, extra_cost=prepared.answer_cost, hold_llm=False,
                                         record=False)
        question = request.messages[index].text()
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        context, used = fit_context(found.documents, self.settings.max_context_chars)
        if used:
            messages = augment(request.messages, index, self.template.substitute(context=context, question=question))
        body = request.model_dump(exclude=NOT_FORWARDED, exclude_none=True)
        body.update(messages=messages, model=self.settings.answer.model, max_tokens=max_tokens)
        if request.stream and request.stream_options is not None:
            body["stream_options"] = request.stream_options.model_dump(exclude_none=True)
        pasted = found.documents[:used]
        return body, SearchSummary(mode=found.mode, queries=found.queries, cached=found.cached,
                                   document_ids=[d.id for d in pasted], titles=[d.title for d in pasted],
                                   degraded=found.degraded)

    async def complete(self, prepared: PreparedChat, caller: Caller | None = None) -> dict[str, Any]:
        release = await self.search.admission.take_llm_slots(caller)
        try:
            body, summary = await self._searched(prepared, caller)
            completion = await self.answer.complete(body)
        finally:
            release()  # also when the caller left (cancelled): the slot goes to the next key's turn at once
        completion["search"] = summary.model_dump(mode="json")
        return completion

    async def open_stream(self, prepared: PreparedChat, caller: Caller | None = None
                          ) -> AsyncGenerator[bytes, None]:
        """Search and wait for the first chunk (so that failures up to there answer with their status),
        then the server-sent events of the rest; the first chunk carries `search`."""
        release = await self.search.admission.take_llm_slots(caller)
        try:
            body, summary = await self._searched(prepared, caller)
            chunks = self.answer.stream(body)
            try:
                first = await anext(chunks)
            except StopAsyncIteration:
                raise UpstreamError("answer LLM ended its stream without a completion") from None
            except BaseException:
                await chunks.aclose()
                raise  # a stream that ended before any chunk raised (the backend failed): its status
        except BaseException:
            release()
            raise
        return self._events(first, chunks, summary, release)

    async def _events(self, first: dict[str, Any], chunks: AsyncGenerator[dict[str, Any], None],
                      summary: SearchSummary, release: Callable[[], None]) -> AsyncGenerator[bytes, None]:
        try:
            async with aclosing(chunks):
                yield event({**first, "search": summary.model_dump(mode="json")})
                try:
                    async for chunk in chunks:
                        yield event(chunk)
                except ServiceError as exc:
                    logger.warning("answer stream failed after it began: %s", exc.message)
                    yield event({"error": {"type": exc.type, "message": exc.message}})
                    return  # no [DONE]: the answer did not finish
        finally:
            release()  # the LLM is done with this request (or the caller left: closing stopped it)
        yield DONE
