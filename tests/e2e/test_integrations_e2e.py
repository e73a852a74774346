"""The integrations against real processes: retriever (bm25s over the shared corpus), a scripted policy
(`tests.support.fake_llm` + `tests.support.fake_policy`, so s3 runs valid actions quickly), the
searcher with an API key and the answering proxy on llama.cpp + SmolLM2 (the `llama_url` fixture).

- `plugsearch.SearchClient` searches the real searcher over HTTP with its key.
- `plugsearch-mcp` over stdio and over streamable HTTP, each driven by the `mcp` SDK's own client: the
  `search` and `feedback` tools are listed and called (a mark on what the search returned).
- the `openai` client gets a search-augmented answer from SmolLM2 through `/v1/chat/completions`, streamed
  and not.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from plugsearch.common.llama_server import DEFAULT_MODEL_ALIAS
from plugsearch.common.workers import free_port
from tests.support.services import (
    REPO,
    ensure_bm25_index,
    python_process,
    retriever_process,
    scripted_policy_process,
    searcher_process,
)

pytestmark = pytest.mark.e2e

KEY = "e2e-integrations-key"
QUESTION = "who wrote the novel the call of the wild"


@pytest.fixture(scope="module")
def searcher_url(data_dir: Path, var_dir: Path, llama_url: str) -> Iterator[str]:
    corpus = data_dir / "corpus" / "combined.jsonl"
    logs = var_dir / "logs"
    extra = {"api_keys": KEY, "chat__answer__base_url": llama_url, "chat__answer__model": DEFAULT_MODEL_ALIAS,
             "chat__answer__timeout_s": "120", "chat__mode": "naive"}
    with retriever_process(corpus, ensure_bm25_index(corpus, var_dir), logs / "integrations_retriever.log") as r, \
            scripted_policy_process(logs / "integrations_policy.log") as policy, \
            searcher_process(r, policy, logs / "integrations_searcher.log", policy_model="scripted-policy",
                             extra=extra) as url:
        yield url


def test_public_client_against_the_real_searcher(searcher_url: str) -> None:
    import plugsearch

    with plugsearch.SearchClient(searcher_url, api_key=KEY, timeout=60) as client:
        assert client.ready()
        found = client.search(QUESTION, mode="s3")
        assert found.stop_reason == "complete" and found.documents and found.queries
        assert found.context.startswith("Doc 1(Title: ")
        naive = client.search(QUESTION, mode="naive", retrieve_k=3)
        assert len(naive.documents) == 3
    with plugsearch.SearchClient(searcher_url, max_retries=0) as anonymous, pytest.raises(plugsearch.Unauthorized):
        anonymous.search(QUESTION)


def check_tool(result: Any, budget: int) -> dict[str, Any]:
    assert not result.is_error, result.content
    found: dict[str, Any] = result.structured_content
    assert found is not None and 1 <= len(found["documents"]) <= budget
    assert found["context"].startswith("Doc 1(Title: ") and found["question"] == QUESTION
    return found


def check_mark(result: Any, found: dict[str, Any]) -> None:
    assert not result.is_error, result.content
    assert result.structured_content["search_id"] == found["search_id"]
    assert result.structured_content["helpful"] == [found["documents"][0]["id"]]


async def test_mcp_over_stdio(searcher_url: str) -> None:
    from mcp import Client, StdioServerParameters

    server = StdioServerParameters(command=sys.executable, args=["-m", "plugsearch.mcp_server"], cwd=str(REPO),
                                   env={**os.environ, "PLUGSEARCH_MCP_SEARCHER_URL": searcher_url,
                                        "PLUGSEARCH_MCP_API_KEY": KEY, "PLUGSEARCH_MCP_LOG_LEVEL": "warning"})
    async with Client(server, read_timeout_seconds=120) as client:
        assert [t.name for t in (await client.list_tools()).tools] == ["search", "feedback"]
        found = check_tool(await client.call_tool("search", {"question": QUESTION, "mode": "s3", "budget": 2}), 2)
        check_mark(await client.call_tool("feedback", {"search_id": found["search_id"],
                                                       "helpful": [found["documents"][0]["id"]]}), found)


async def test_mcp_over_streamable_http(searcher_url: str, var_dir: Path) -> None:
    from mcp import Client

    port = free_port()
    args = ["-m", "plugsearch.mcp_server", "--transport", "http", "--port", str(port), "--searcher-url", searcher_url]
    with python_process(args, f"http://127.0.0.1:{port}/health", var_dir / "logs" / "integrations_mcp_http.log",
                        env={"PLUGSEARCH_MCP_API_KEY": KEY}):
        async with Client(f"http://127.0.0.1:{port}/mcp", read_timeout_seconds=120) as client:
            assert [t.name for t in (await client.list_tools()).tools] == ["search", "feedback"]
            found = check_tool(await client.call_tool("search", {"question": QUESTION, "mode": "naive", "budget": 4}),
                               4)
            check_mark(await client.call_tool("feedback", {"search_id": found["search_id"],
                                                           "helpful": [found["documents"][0]["id"]]}), found)


def test_openai_client_gets_a_search_augmented_answer_from_the_real_llm(searcher_url: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{searcher_url}/v1", api_key=KEY, timeout=180, max_retries=0)
    messages: Any = [{"role": "user", "content": QUESTION}]
    options: Any = {"search": {"retrieve_k": 3}}
    answer = client.chat.completions.create(model="plugsearch", messages=messages, max_tokens=24, temperature=0,
                                            extra_body=options)
    assert (answer.choices[0].message.content or "").strip()
    search = (answer.model_extra or {})["search"]
    assert search["mode"] == "naive" and len(search["document_ids"]) == 3
    stream = client.chat.completions.create(model="plugsearch", messages=messages, max_tokens=24, temperature=0,
                                            extra_body=options, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([p for p in pieces if p]) > 1 and "".join(pieces).strip()
    client.close()
