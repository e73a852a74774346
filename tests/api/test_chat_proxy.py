"""The OpenAI-compatible answering proxy, driven by the official `openai` client against the real searcher
app in-process: scripted fake policy, fake retriever app, and a fake answer LLM (OpenAI wire format,
streaming included) that records what it was sent."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from plugsearch.common.llm import LLMSettings, OpenAIChatClient
from plugsearch.searcher.api import create_app
from plugsearch.searcher.retrieval import ServiceRetriever
from plugsearch.searcher.settings import ChatProxySettings, SearcherSettings
from tests.api.test_searcher_api import Q, Stack
from tests.asgi import app_client
from tests.support.chat_policy import chat as chat_policy
from tests.support.fake_llm import create_fake_llm_app, last_user

KEY = "chat-proxy-key-123"


def answer_from_context(body: dict[str, Any]) -> str:
    """A deterministic 'answer': how many documents the last user message carries."""
    return f"answered from {last_user(body).count('Doc ')} documents"


class ChatStack(Stack):
    """`chat`: more `ChatProxySettings` fields; `answer_llm`: another answer LLM app than the fake one."""

    def __init__(self, *, chat: dict[str, Any] | None = None, answer_llm: Any = None, **settings: Any) -> None:
        settings.setdefault("api_keys", KEY)
        super().__init__(**settings)
        self.answer_llm = answer_llm or create_fake_llm_app(answer_from_context, model="answer-model")
        self.answer = OpenAIChatClient(LLMSettings(base_url="http://answer/v1", model="answer-model", max_retries=0),
                                       name="answer", transport=httpx.ASGITransport(app=self.answer_llm))
        chat = ChatProxySettings(answer=LLMSettings(base_url="http://answer/v1", model="answer-model"),
                                 **(chat or {}))
        self.app = create_app(SearcherSettings(chat=chat, **settings), policy=chat_policy(self.policy),
                              retriever=ServiceRetriever(self.retriever_client), cache=self.cache, answer=self.answer)

    async def aclose(self) -> None:
        await super().aclose()
        await self.answer.aclose()


@pytest.fixture()
async def chat() -> AsyncIterator[tuple[ChatStack, openai.AsyncOpenAI]]:
    stack = ChatStack()
    async with app_client(stack.app):
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=stack.app))
        client = openai.AsyncOpenAI(base_url="http://searcher/v1", api_key=KEY, http_client=http, max_retries=0)
        yield stack, client
        await client.close()
    await stack.aclose()


async def test_openai_client_gets_a_search_augmented_answer(chat: tuple[ChatStack, openai.AsyncOpenAI]) -> None:
    stack, client = chat
    response = await client.chat.completions.create(
        model="plugsearch", temperature=0.3, top_p=0.9,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": Q}])
    assert response.choices[0].message.content == "answered from 8 documents"  # s3: 2 + 3 searches x 2 marked
    search = (response.model_extra or {})["search"]
    assert search["mode"] == "s3" and len(search["document_ids"]) == 8 and len(search["queries"]) == 3
    sent = stack.answer_llm.state.bodies[-1]
    assert sent["model"] == "answer-model" and sent["temperature"] == 0.3 and sent["top_p"] == 0.9
    assert "search" not in sent and sent["stream"] is True  # asked as a stream: a caller leaving stops it
    assert sent["messages"][0] == {"role": "system", "content": "Be brief."}
    user = sent["messages"][-1]["content"]
    assert user.endswith(f"Question: {Q}") and f"Doc 1(Title: T1) passage 1 for {Q}" in user

    naive = await client.chat.completions.create(model="plugsearch", messages=[{"role": "user", "content": Q}],
                                                 extra_body={"search": {"mode": "naive", "retrieve_k": 3}})
    assert naive.choices[0].message.content == "answered from 3 documents"
    assert stack.retriever_app.state.requests[-1].k == 3
    models = await client.models.list()
    assert [m.id for m in models.data] == ["plugsearch"]


async def test_openai_client_streams_the_answer(chat: tuple[ChatStack, openai.AsyncOpenAI]) -> None:
    stack, client = chat
    stream = await client.chat.completions.create(
        model="plugsearch", stream=True, extra_body={"search": {"mode": "naive", "retrieve_k": 4}},
        messages=[{"role": "user", "content": [{"type": "text", "text": Q}]}])
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "answered from 4 documents" and len(chunks) >= 4
    assert (chunks[0].model_extra or {})["search"]["mode"] == "naive"
    assert chunks[-1].choices[0].finish_reason == "stop"
    sent = stack.answer_llm.state.bodies[-1]
    assert sent["stream"] is True and sent["messages"][-1]["content"][0]["type"] == "text"


async def test_errors_keep_their_meaning(chat: tuple[ChatStack, openai.AsyncOpenAI]) -> None:
    stack, client = chat
    with pytest.raises(openai.BadRequestError, match="no user message"):
        await client.chat.completions.create(model="m", messages=[{"role": "system", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="search options"):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": Q}],
                                             extra_body={"search": {"retrieve_k": 2, "select_k": 3}})
    with pytest.raises(openai.UnprocessableEntityError):
        await client.chat.completions.create(model="m", messages=[], temperature=1)
    wrong = openai.AsyncOpenAI(base_url="http://searcher/v1", api_key="not-the-key", max_retries=0,
                               http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=stack.app)))
    with pytest.raises(openai.AuthenticationError):
        await wrong.chat.completions.create(model="m", messages=[{"role": "user", "content": Q}])
    await wrong.close()
    stack.answer_llm.state.fail_status = 500
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as failed:  # 502 before anything was streamed
            await client.chat.completions.create(model="m", stream=stream, messages=[{"role": "user", "content": Q}],
                                                 extra_body={"search": {"mode": "naive"}})
        assert failed.value.status_code == 502


async def test_proxy_is_off_unless_configured() -> None:
    stack = Stack()
    try:
        async with app_client(stack.app) as client:
            response = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": Q}]})
            assert response.status_code == 404 and response.json()["error"]["type"] == "not_found"
    finally:
        await stack.aclose()
