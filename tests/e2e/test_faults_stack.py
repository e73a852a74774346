"""Fault injection on the local stack, real processes (`bench.load.LocalStack`: redis-server, the
retriever over the shared combined corpus, the searcher with Redis caches and the internal token, and
the fake OpenAI-compatible LLM process answering with the scripted s3 policy):

- the policy LLM is killed (SIGKILL) during a stream of searches: they come back 200 `degraded` with
  documents, never a 5xx; restarted, searches are whole again without restarting the searcher;
- Redis is killed: searches still succeed (the cache is bypassed); restarted, it is used again;
- the retriever is restarted: the searcher's readiness goes 503 -> 200 and searches resume (while it is stopped
  they answer 503 + Retry-After once `SEARCHER_RETRIEVER_WAIT_S` has passed).

Every question is distinct, so no answer comes from the searcher's cache unless a test asks for that.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.load import LocalStack
from plugsearch.common.qa import load_qa

pytestmark = pytest.mark.e2e

SEARCHER_ENV = {
    # Fail fast and recover fast: no retries of a dead policy, a short breaker.
    "SEARCHER_POLICY__TIMEOUT_S": "3", "SEARCHER_POLICY__MAX_RETRIES": "0",
    "SEARCHER_POLICY__BREAKER_FAILURES": "2", "SEARCHER_POLICY__BREAKER_RESET_S": "1",
    "SEARCHER_RETRIEVER__MAX_RETRIES": "1", "SEARCHER_RETRIEVER__BREAKER_RESET_S": "1",
    # a stopped retriever is waited for this long before the 503 (a supervised one comes back: 20 s by default)
    "SEARCHER_RETRIEVER_WAIT_S": "2",
    "SEARCHER_SEARCH_TIMEOUT_S": "20", "SEARCHER_REQUEST_TIMEOUT_S": "30",
}


@pytest.fixture(scope="module")
def stack(data_dir: Path, var_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    # A little LLM latency keeps searches in flight when a test kills a process.
    local = LocalStack((data_dir / "corpus" / "combined.jsonl").resolve(), var_dir, llm_latency_ms=10.0,
                       searcher_env=SEARCHER_ENV, log_dir=tmp_path_factory.mktemp("fault_logs"))
    with local:
        yield local


@pytest.fixture(autouse=True)
def whole_stack(stack: LocalStack) -> None:
    """Each test starts on a whole stack, even when an earlier one failed before it restarted a process."""
    stack.revive()


@pytest.fixture(scope="module")
def questions(data_dir: Path) -> Iterator[str]:
    return itertools.cycle([r.question for r in load_qa(data_dir / "qa" / "nq.jsonl", 1000)])


async def search(client: httpx.AsyncClient, question: str) -> httpx.Response:
    return await client.post("/search", json={"question": question, "mode": "s3"})


def check_answer(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    assert body["documents"], body
    return body


async def test_dead_policy_llm_degrades_searches_then_recovers(stack: LocalStack, questions: Iterator[str]) -> None:
    searcher_pid = stack.procs["searcher"].pid
    async with httpx.AsyncClient(base_url=stack.url("searcher"), timeout=30) as client:
        healthy = [check_answer(await search(client, next(questions))) for _ in range(3)]
        assert all(not b["degraded"] and b["stop_reason"] == "complete" for b in healthy)

        # Streams of concurrent searches; the LLM dies in the middle of them. Each stream goes on for
        # two searches after the kill, however fast the machine finished the ones before it.
        killed = asyncio.Event()

        async def stream() -> list[httpx.Response]:
            responses: list[httpx.Response] = []
            after = 0
            while after < 2 and len(responses) < 200:
                after += killed.is_set()
                responses.append(await search(client, next(questions)))
            return responses

        streams = [asyncio.create_task(stream()) for _ in range(4)]
        await asyncio.sleep(0.3)
        stack.stop("llm", signal.SIGKILL)
        killed.set()
        during = [r for task in streams for r in await task]
        assert all(r.status_code == 200 for r in during), [r.text for r in during if r.status_code != 200]
        bodies = [check_answer(r) for r in during]
        after_kill = [check_answer(await search(client, next(questions))) for _ in range(4)]
        for body in after_kill:
            assert body["degraded"] and body["stop_reason"] in ("policy_error", "policy_timeout"), body
        assert any(b["degraded"] for b in bodies)

        stack.start("llm")
        stack.wait_ready("llm", timeout_s=60)
        deadline = time.monotonic() + 30
        while True:  # the breaker lets a trial through within its reset time; no searcher restart
            body = check_answer(await search(client, next(questions)))
            if not body["degraded"]:
                break
            assert time.monotonic() < deadline, f"still degraded 30 s after the LLM came back: {body}"
            await asyncio.sleep(0.2)
        assert body["stop_reason"] == "complete" and len(body["queries"]) > 1
    assert stack.procs["searcher"].pid == searcher_pid and stack.procs["searcher"].poll() is None


async def test_dead_redis_is_bypassed(stack: LocalStack, questions: Iterator[str]) -> None:
    async with httpx.AsyncClient(base_url=stack.url("searcher"), timeout=30) as client:
        question = next(questions)
        first = check_answer(await search(client, question))
        assert not first["cached"]
        assert check_answer(await search(client, question))["cached"]  # Redis serves the repeat

        stack.stop("redis", signal.SIGKILL)
        for _ in range(4):
            body = check_answer(await search(client, next(questions)))
            assert not body["degraded"]
        repeat = check_answer(await search(client, question))
        assert not repeat["cached"] and not repeat["degraded"]  # computed again, not failed
        metrics = (await client.get("/metrics")).text
        assert 'searcher_cache_events_total{cache="search",event="error"}' in metrics

        stack.start("redis")
        stack.wait_ready("redis", timeout_s=30)
        question = next(questions)
        check_answer(await search(client, question))
        deadline = time.monotonic() + 30
        while not check_answer(await search(client, question))["cached"]:  # reconnected, cached again
            assert time.monotonic() < deadline, "the searcher never used Redis again"
            await asyncio.sleep(0.5)
            check_answer(await search(client, question))


async def test_retriever_restart_readiness_and_resume(stack: LocalStack, questions: Iterator[str]) -> None:
    async with httpx.AsyncClient(base_url=stack.url("searcher"), timeout=30) as client:
        check_answer(await search(client, next(questions)))
        assert (await client.get("/health/ready")).status_code == 200

        stack.stop("retriever")
        down = await client.get("/health/ready")
        assert down.status_code == 503 and down.json()["checks"]["retriever"] != "ok"
        refused = await search(client, next(questions))
        assert refused.status_code == 503 and "retry-after" in refused.headers
        assert refused.json()["error"]["type"] == "upstream_unavailable"

        stack.start("retriever")
        searcher_ready: list[int] = []
        retriever_ready: list[int | str] = []
        deadline = time.monotonic() + 240
        async with httpx.AsyncClient(base_url=stack.url("retriever"), timeout=5) as retriever:
            while True:
                try:
                    retriever_ready.append((await retriever.get("/health/ready")).status_code)
                except httpx.TransportError:
                    retriever_ready.append("refused")
                searcher_ready.append((await client.get("/health/ready")).status_code)
                if searcher_ready[-1] == 200:
                    break
                assert time.monotonic() < deadline, f"searcher not ready again: {retriever_ready[-5:]}"
                await asyncio.sleep(0.1)
            final = (await retriever.get("/health/ready")).status_code
        assert searcher_ready[0] == 503 and searcher_ready[-1] == 200
        # Not listening, then 503 while its index loads, then 200 (polled just before the searcher).
        assert set(retriever_ready) <= {"refused", 503, 200} and final == 200, retriever_ready
        if 200 in retriever_ready:  # once ready, it stays ready
            assert set(retriever_ready[retriever_ready.index(200):]) == {200}, retriever_ready
        deadline = time.monotonic() + 15
        while True:  # the retriever breaker may still be open for up to its reset time
            response = await search(client, next(questions))
            if response.status_code == 200:
                break
            assert response.status_code == 503 and time.monotonic() < deadline, response.text
            await asyncio.sleep(0.5)
        for _ in range(3):
            body = check_answer(await search(client, next(questions)))
            assert not body["degraded"]
