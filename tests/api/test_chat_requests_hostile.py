"""Issue 39: what a hostile caller sent the chat proxy, verbatim, and what it gets now. The real searcher app
in-process, fake answer LLMs (the real llama.cpp server: tests/e2e/test_chat_proxy_e2e.py).

- fields outside OpenAI's allow-list (llama.cpp's `grammar`, which crashed the whole stack) and caller-shaped
  parameters the answer LLM would refuse or choke on are 422 before any search or generation; backend
  extensions pass only when the operator names them, and still within their ranges;
- an answer LLM's 4xx to the caller's parameters is the caller's 422, not a 502;
- a JSON body without Content-Type is 415, as the docs say;
- a stream that ends without finishing ends with an `error` event (a non-streamed answer: the envelope);
- the prompt is bounded, and the LLM's one slot goes to waiting keys in turn: a key's chat waits for the
  other key's answer in flight, never behind a queue of them, and a non-streamed chat whose client left
  gives its slot back at once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from plugsearch.common.llm import LLMSettings
from plugsearch.searcher.settings import ChatProxySettings
from tests.api.test_chat_proxy import KEY, ChatStack
from tests.api.test_searcher_api import Q
from tests.api.test_shared_resources_hostile import AUTH, OTHER, OTHER_KEY, chat_body, until
from tests.asgi import app_client, served_in_thread

CHAT = "/v1/chat/completions"

GRAMMAR = {"messages": [{"role": "user", "content": "is paris in france"}], "max_tokens": 8,
           "grammar": "this is not a grammar"}
"""The request that crashed llama.cpp (and, before supervision, the whole stack)."""
UNTERMINATED_GRAMMAR = {**GRAMMAR, "grammar": 'root ::= "a'}

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}
IMAGE_MESSAGE = [{"role": "user", "content": [
    {"type": "text", "text": "is paris in france"},
    {"type": "image_url", "image_url": {"url": "https://example.org/paris.png"}}]}]

CALLER_SHAPED = [
    pytest.param({"logprobs": True, "top_logprobs": 5}, "logprobs", id="logprobs+top_logprobs"),
    pytest.param({"top_k": -5}, "top_k", id="top_k"),
    pytest.param({"min_p": 5}, "min_p", id="min_p"),
    pytest.param({"mirostat_mode": 9}, "mirostat_mode", id="mirostat_mode"),
    pytest.param({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
                 "tool_choice", id="tool_choice-missing-function"),
    pytest.param({"messages": IMAGE_MESSAGE}, "messages", id="image_url"),
]
"""Each gave 502 `upstream_error` after the search ran and was charged."""


@pytest.fixture()
async def chat() -> AsyncIterator[tuple[ChatStack, httpx.AsyncClient]]:
    stack = ChatStack()
    async with app_client(stack.app) as client:
        yield stack, client
    await stack.aclose()


def nothing_done(stack: ChatStack) -> bool:
    return stack.answer_llm.state.calls == 0 and stack.retriever_app.state.requests == []


# ----------------------------------------------------------------------------- the allow-list
@pytest.mark.parametrize("body", [GRAMMAR, UNTERMINATED_GRAMMAR], ids=["grammar", "unterminated-grammar"])
async def test_grammar_is_refused_before_any_work(chat: tuple[ChatStack, httpx.AsyncClient],
                                                  body: dict[str, Any]) -> None:
    stack, client = chat
    for stream in (False, True):
        response = await client.post(CHAT, headers=AUTH, json={**body, "stream": stream})
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["type"] == "validation_error" and error["param"] == "grammar", error
    assert nothing_done(stack)


@pytest.mark.parametrize(("fields", "param"), CALLER_SHAPED)
async def test_caller_shaped_parameters_are_422_before_any_work(
        chat: tuple[ChatStack, httpx.AsyncClient], fields: dict[str, Any], param: str) -> None:
    stack, client = chat
    body = {"messages": [{"role": "user", "content": "is paris in france"}], "max_tokens": 8, **fields}
    response = await client.post(CHAT, headers=AUTH, json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"].startswith(param), response.text
    assert nothing_done(stack)


async def test_named_extensions_pass_within_their_ranges_and_grammar_never() -> None:
    stack = ChatStack(chat={"extensions": ["top_k", "min_p", "mirostat", "image_url"]})
    try:
        async with app_client(stack.app) as client:
            for fields, param in (({"top_k": -5}, "top_k"), ({"min_p": 5}, "min_p"),
                                  ({"mirostat_mode": 9}, "mirostat_mode"), ({"repeat_penalty": 1.1}, "repeat_penalty"),
                                  ({"grammar": "root ::= \"yes\""}, "grammar")):
                response = await client.post(CHAT, headers=AUTH, json=chat_body(**fields))
                assert response.status_code == 422, response.text
                assert response.json()["error"]["param"] == param
            assert nothing_done(stack)
            allowed = {"top_k": 40, "min_p": 0.05, "mirostat_mode": 2, "mirostat_tau": 5.0}
            response = await client.post(CHAT, headers=AUTH, json={**chat_body(**allowed), "messages": IMAGE_MESSAGE})
            assert response.status_code == 200, response.text
            sent = stack.answer_llm.state.bodies[-1]
            assert {k: sent[k] for k in allowed} == allowed
            assert sent["messages"][-1]["content"][1] == IMAGE_MESSAGE[0]["content"][1]  # the image kept
    finally:
        await stack.aclose()
    with pytest.raises(ValueError, match="extensions"):
        ChatProxySettings(answer=LLMSettings(), extensions=["grammar"])  # type: ignore[list-item]


async def test_tools_and_the_rest_of_the_allow_list_are_forwarded_as_checked(
        chat: tuple[ChatStack, httpx.AsyncClient]) -> None:
    stack, client = chat
    fields = {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
              "parallel_tool_calls": False, "response_format": {"type": "json_object"}, "user": "u-1",
              "logprobs": False, "stop": ["\n\n"], "seed": 7}
    response = await client.post(CHAT, headers=AUTH, json=chat_body(**fields))
    assert response.status_code == 200, response.text
    sent = stack.answer_llm.state.bodies[-1]
    assert sent["tools"] == [WEATHER_TOOL] and sent["tool_choice"] == fields["tool_choice"]
    assert sent["response_format"] == {"type": "json_object"} and sent["seed"] == 7 and "logprobs" not in sent
    for bad, param in (({"tool_choice": "required"}, "tool_choice"), ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools"),
                       ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
                       ({"tools": [{**WEATHER_TOOL, "function": {"name": "a b"}}]}, "tools"),
                       ({"messages": [{"role": "tool", "content": "17 C"}]}, "messages"),
                       ({"stream_options": {"include_usage": True}}, "stream_options"),
                       ({"service_tier": "flex"}, "service_tier")):
        response = await client.post(CHAT, headers=AUTH, json=chat_body(**bad))
        assert response.status_code == 422, (bad, response.text)
        assert response.json()["error"]["param"].startswith(param), (bad, response.text)
    assert stack.answer_llm.state.calls == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_llm_400_to_the_callers_parameters_is_the_callers_422(
        chat: tuple[ChatStack, httpx.AsyncClient], stream: bool) -> None:
    stack, client = chat
    stack.answer_llm.state.fail_status = 400
    for _ in range(6):  # more than the breaker's failures: a caller's bad parameters never open it
        response = await client.post(CHAT, headers=AUTH, json=chat_body(stream=stream))
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["type"] == "validation_error" and "injected failure" not in response.text, error
    stack.answer_llm.state.fail_status = None
    assert (await client.post(CHAT, headers=AUTH, json=chat_body(stream=stream))).status_code == 200


async def test_a_json_body_without_content_type_is_415(chat: tuple[ChatStack, httpx.AsyncClient]) -> None:
    stack, client = chat
    for path, body in ((CHAT, chat_body()), ("/search", {"question": Q, "mode": "naive"})):
        response = await client.post(path, headers=AUTH, content=orjson.dumps(body))
        assert response.status_code == 415, response.text
        assert response.json()["error"]["type"] == "unsupported_media_type"
    assert nothing_done(stack)


# ---------------------------------------------------------------------- streams that do not finish
def chunk(content: str | None = None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    return b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + b"\n\n"


FINISHED = chunk("Paris") + chunk(" is.") + chunk(finish="stop") + b"data: [DONE]\n\n"
UNFINISHED = {
    "no [DONE]": chunk("Paris") + chunk(" is"),
    "backend error": chunk("Paris") + b'data: {"error": {"message": "Requested tokens (10270) exceed context window '
                                      b'of 8192", "type": "internal_server_error"}}\n\n',
    "[DONE] before a finish reason": chunk("Paris") + b"data: [DONE]\n\n",
    "nothing at all": b"",
}


def scripted_answer_llm() -> FastAPI:
    """An answer LLM whose streamed body is `app.state.script`; a request whose last message contains "hold"
    waits for `app.state.release` first. `app.state.started`: the last user message of each call, in order;
    `app.state.cancelled` (a threading.Event): a held call was cancelled."""
    app = FastAPI()
    app.state.script = FINISHED
    app.state.calls = 0
    app.state.started = []
    app.state.release = asyncio.Event()
    app.state.cancelled = threading.Event()

    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> Response:
        body = orjson.loads(await request.body())
        app.state.calls += 1
        text = body["messages"][-1]["content"]
        app.state.started.append(text.rsplit("Question: ", 1)[-1])
        if "hold" in text:
            try:
                await app.state.release.wait()
            except asyncio.CancelledError:
                app.state.cancelled.set()
                raise
        return Response(app.state.script, media_type="text/event-stream")

    return app


def events(text: str) -> list[dict[str, Any] | str]:
    out: list[dict[str, Any] | str] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


@pytest.mark.parametrize("script", list(UNFINISHED), ids=list(UNFINISHED))
async def test_a_stream_that_does_not_finish_is_never_a_success(script: str) -> None:
    stack = ChatStack(answer_llm=scripted_answer_llm())
    stack.answer_llm.state.script = UNFINISHED[script]
    try:
        async with app_client(stack.app) as client:
            plain = await client.post(CHAT, headers=AUTH, json=chat_body())
            assert plain.status_code == 502 and plain.json()["error"]["type"] == "upstream_error", plain.text
            streamed = await client.post(CHAT, headers=AUTH, json=chat_body(stream=True))
            if script == "nothing at all":  # failed before the first chunk: the status says so
                assert streamed.status_code == 502 and streamed.json()["error"]["type"] == "upstream_error"
            else:
                assert streamed.status_code == 200
                got = events(streamed.text)
                assert isinstance(got[0], dict) and got[0]["search"]["mode"] == "naive"  # the chunk that came
                last = got[-1]
                assert isinstance(last, dict) and last == {"error": {"type": "upstream_error",
                                                                      "message": last["error"]["message"]}}, got
                assert "[DONE]" not in got and "Requested tokens" not in streamed.text  # its text: logged only
            stack.answer_llm.state.script = FINISHED  # the same proxy, a finished answer: a success
            done = await client.post(CHAT, headers=AUTH, json=chat_body(stream=True))
            assert events(done.text)[-1] == "[DONE]"
            whole = await client.post(CHAT, headers=AUTH, json=chat_body())
            assert whole.json()["choices"][0]["message"]["content"] == "Paris is."
    finally:
        await stack.aclose()


# -------------------------------------------------------------------------- prompts, and the LLM's turns
async def test_the_prompt_is_bounded_before_any_work_and_the_documents_cut_to_fit() -> None:
    stack = ChatStack(chat={"max_prompt_chars": 2_000, "max_context_chars": 120})
    try:
        async with app_client(stack.app) as client:
            long = await client.post(CHAT, headers=AUTH, json={  # the 24,000-character message
                "messages": [{"role": "user", "content": "is paris in france " * 1263}], "max_tokens": 16})
            assert long.status_code == 422, long.text
            error = long.json()["error"]
            assert error["type"] == "cost_limit_exceeded" and error["param"] == "messages", error
            assert nothing_done(stack)
            response = await client.post(CHAT, headers=AUTH, json=chat_body(search={"mode": "naive", "retrieve_k": 8}))
            assert response.status_code == 200, response.text
            pasted = response.json()["search"]["document_ids"]
            assert 1 <= len(pasted) < 8  # eight were found; those past 120 characters left out
            prompt = stack.answer_llm.state.bodies[-1]["messages"][-1]["content"]
            context = prompt.split("\n\nQuestion: ")[0].split("\n\n", 1)[1]
            assert len(context) <= 120 and context.count("Doc ") == len(pasted)
    finally:
        await stack.aclose()


async def test_waiting_chats_are_served_across_keys_in_turn() -> None:
    """One LLM slot: key B's chat waits for key A's answer in flight (it is not sent to the LLM meanwhile,
    where it would queue behind whatever A sends next), and is served next; A cannot queue a second one."""
    stack = ChatStack(api_keys=f"{KEY},{OTHER_KEY}", llm_slots=1, answer_llm=scripted_answer_llm())
    llm = stack.answer_llm.state
    try:
        async with app_client(stack.app) as client:
            def ask(headers: dict[str, str], text: str) -> Any:
                return client.post(CHAT, headers=headers, json={**chat_body(), "messages": [
                    {"role": "user", "content": text}]})

            a1 = asyncio.create_task(ask(AUTH, "hold the line for key A"))
            await until(lambda: llm.started == ["hold the line for key A"])
            b1 = asyncio.create_task(ask(OTHER, "key B's short question"))
            await asyncio.sleep(0.3)
            assert not b1.done() and llm.calls == 1  # waiting for its turn, not queued at the LLM
            a2 = await ask(AUTH, "key A again")
            assert a2.status_code == 429 and a2.json()["error"]["type"] == "rate_limited", a2.text
            assert int(a2.headers["retry-after"]) >= 1
            llm.release.set()
            assert (await a1).status_code == 200
            assert (await b1).status_code == 200
            assert llm.started == ["hold the line for key A", "key B's short question"]
    finally:
        await stack.aclose()


async def test_a_non_streamed_chat_whose_client_left_gives_the_llm_back() -> None:
    stack = ChatStack(api_keys=f"{KEY},{OTHER_KEY}", llm_slots=1, llm_wait_s=5, answer_llm=scripted_answer_llm())
    llm = stack.answer_llm.state
    try:
        with served_in_thread(stack.app) as url:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                left = asyncio.create_task(client.post(CHAT, headers=AUTH, json={
                    **chat_body(), "messages": [{"role": "user", "content": "hold on, I am leaving"}]}))
                await until(lambda: llm.calls == 1)
                left.cancel()  # the client hangs up: its connection closes
                with pytest.raises(asyncio.CancelledError):
                    await left
            assert await asyncio.to_thread(llm.cancelled.wait, 10), "the answer was not stopped"
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                other = await client.post(CHAT, headers=OTHER, json=chat_body())
                assert other.status_code == 200, other.text  # the slot was free: no wait, no 429
                assert llm.calls == 2
    finally:
        await stack.aclose()


async def test_a_key_that_keeps_sending_refused_chats_spends_its_budget_and_meets_the_door() -> None:
    stack = ChatStack(rate_limit_per_s=0.01, rate_limit_burst=20, max_request_cost=20)
    long = {"messages": [{"role": "user", "content": "is paris in france " * 1263}], "max_tokens": 16}
    try:
        async with app_client(stack.app) as client:
            statuses = [(await client.post(CHAT, headers=AUTH, json=long)).status_code for _ in range(24)]
            assert statuses[:21] == [422] * 21 and set(statuses[21:]) == {429}, statuses  # 20 units, then broke
            assert nothing_done(stack)
    finally:
        await stack.aclose()
