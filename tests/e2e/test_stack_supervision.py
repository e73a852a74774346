"""Supervision, not suicide (issue 39), on a real `plugsearch-stack` (real Redis, llama.cpp with SmolLM2 as the
s3 policy and as the chat proxy's answer LLM, the retriever over 500 passages of the shared corpus, generator,
judge, searcher; `--policy base`, so that `/search` really depends on the LLM):

- the request that crashed llama.cpp and, with it, the whole stack (`grammar`) is refused with 422 before it
  reaches llama.cpp, and the context-overflowing stream is refused before any work: llama.cpp keeps its pid;
- the LLM killed with SIGSEGV under a load of s3 searches: the stack restarts it (logged) while every other
  process keeps its pid; every search is answered 200 with documents, `degraded: true` (naive documents) while
  the LLM is down, whole again once it is back;
- the retriever killed with SIGSEGV under a load of searches: restarted the same way. Nothing can retrieve
  while it is down, so what "answers throughout" means here: every search, a question asked before too (the
  searcher answers from its cache only after reading the index's identity from the retriever, so not while it is
  down), waits for the restarted retriever (`SEARCHER_RETRIEVER_WAIT_S`, 20 s) and is answered then with its real
  documents; no request fails or goes unanswered.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest

from plugsearch.common.qa import load_qa
from tests.e2e.test_stack import alive, descendants, log_tail, wait_ready
from tests.e2e.test_stack_failures import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")]

READY_TIMEOUT_S = 600.0
S3 = {"mode": "s3", "max_turns": 1, "retrieve_k": 3, "select_k": 2}


class Stack(NamedTuple):
    proc: subprocess.Popen[bytes]
    info: dict[str, Any]
    log: Path

    def pid(self, name: str) -> int:
        """The member's pid, as the stack last logged starting it."""
        found = re.findall(rf"\| {name} started \(pid=(\d+)\)", self.log.read_text(errors="replace"))
        assert found, f"{name} never started:\n{log_tail(self.log)}"
        return int(found[-1])

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def stack(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("supervised")
    corpus = tmp / "small.jsonl"
    with (data_dir / "corpus" / "combined.jsonl").open() as src:
        corpus.write_text("".join(next(src) for _ in range(500)))
    ready_file, log = tmp / "ready.json", tmp / "stack.log"
    # short prompts keep each SmolLM2 call quick on two busy cores; the searcher fails fast on a dead LLM
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SEARCHER_DOC_CHARS": "200", "SEARCHER_MAX_NEW_TOKENS": "48",
           "SEARCHER_POLICY__MAX_RETRIES": "0", "SEARCHER_POLICY__BREAKER_RESET_S": "1",
           "SEARCHER_SEARCH_TIMEOUT_S": "100", "SEARCHER_REQUEST_TIMEOUT_S": "150"}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "plugsearch.stack", "--free-ports", "--no-color", "--chat",
                                 "--policy", "base", "--corpus", str(corpus), "--var-dir", str(tmp / "var"),
                                 "--ready-file", str(ready_file), "--ready-timeout", str(READY_TIMEOUT_S)],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    seen: dict[int, str] = {}
    try:
        wait_ready(proc, ready_file, log, READY_TIMEOUT_S + 120)
        seen = descendants(proc.pid)
        yield Stack(proc, json.loads(ready_file.read_text()), log)
    finally:
        seen.update(descendants(proc.pid))
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        time.sleep(0.5)
        for pid in alive(seen):  # nothing may outlive the stack, restarted processes included
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"process {pid} outlived the stack:\n{log_tail(log)}")


@pytest.fixture(scope="module")
def questions(data_dir: Path) -> Iterator[str]:
    """Never the same question twice (no answer from the cache unless a test asks for one)."""
    rows = [r.question for r in load_qa(data_dir / "qa" / "nq.jsonl", 1000)][200:]
    return (question if n == 0 else f"{question} ({n})" for n in itertools.count() for question in rows)


def refuses_connections(port: int) -> bool:
    """Nothing accepts on the port (a socket that connected to itself does not count: with nothing listening,
    Linux may pick the port just freed as the source port of a loopback connection to it)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            return bool(sock.getsockname() == sock.getpeername())
    except OSError:
        return True


async def until_logged(stack: Stack, text: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in stack.output():
        assert stack.proc.poll() is None, f"the stack exited:\n{log_tail(stack.log)}"
        assert time.monotonic() < deadline, f"never logged {text!r}:\n{log_tail(stack.log)}"
        await asyncio.sleep(0.2)


Result = tuple[float, float, "httpx.Response | Exception"]


async def load(client: httpx.AsyncClient, questions: Iterator[str], body: dict[str, Any], *, clients: int,
               until: asyncio.Event, results: list[Result]) -> None:
    """`clients` closed-loop clients sending a new question each until `until` is set; each request's
    (sent, answered, answer) appended to `results` as it comes."""
    async def one() -> None:
        while not until.is_set():
            sent = time.monotonic()
            try:
                answer: httpx.Response | Exception = await client.post("/search", json={"question": next(questions),
                                                                                        **body})
            except httpx.HTTPError as exc:
                answer = exc
            results.append((sent, time.monotonic(), answer))

    await asyncio.gather(*(one() for _ in range(clients)))


def answered(results: list[Result]) -> list[dict[str, Any]]:
    """Every answer a 200 with documents (nothing lost, nothing failed): their bodies."""
    bodies = []
    for _, _, answer in results:
        assert isinstance(answer, httpx.Response), f"no answer: {answer!r}"
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["documents"], body
        bodies.append(body)
    return bodies


async def test_the_grammar_that_crashed_llama_cpp_is_refused_and_it_keeps_running(stack: Stack) -> None:
    llm = stack.pid("llm")
    async with httpx.AsyncClient(base_url=stack.info["searcher"], timeout=300) as client:
        for grammar in ("this is not a grammar", 'root ::= "a'):
            response = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "is paris in france"}], "max_tokens": 8, "grammar": grammar})
            assert response.status_code == 422 and response.json()["error"]["param"] == "grammar", response.text
        overflow = await client.post("/v1/chat/completions", json={  # overflowed llama.cpp's context silently
            "messages": [{"role": "user", "content": "wild " * 10_000}], "stream": True})
        assert overflow.status_code == 422, overflow.text
        assert overflow.json()["error"]["type"] == "cost_limit_exceeded"
        answer = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "is paris in france"}], "max_tokens": 8,
            "search": {"mode": "naive", "retrieve_k": 2}})
        assert answer.status_code == 200, answer.text
    assert stack.pid("llm") == llm and alive_pid(llm) and "exited" not in stack.output()


def alive_pid(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def test_a_crashed_llm_is_restarted_while_searches_degrade_then_recover(
        stack: Stack, questions: Iterator[str]) -> None:
    others = {name: stack.pid(name) for name in ("retriever", "searcher", "generator", "judge")}
    llm = stack.pid("llm")
    async with httpx.AsyncClient(base_url=stack.info["searcher"], timeout=200) as client:
        stop, results = asyncio.Event(), list[Result]()
        loading = asyncio.create_task(load(client, questions, S3, clients=3, until=stop, results=results))
        await asyncio.sleep(3)  # searches in flight, some of them inside llama.cpp
        os.kill(llm, signal.SIGSEGV)
        await until_logged(stack, "llm exited (rc=-11, SIGSEGV); restarting it in 1.0 s")
        for _ in range(600):
            if stack.pid("llm") != llm:
                break
            await asyncio.sleep(0.1)
        ready_at = time.monotonic()  # restarted (its readiness probe waits for a gap between calls, under load)
        deadline = ready_at + 240
        while time.monotonic() < deadline and not loading.done():  # until searches come back whole again
            await asyncio.sleep(1)
            if any(sent > ready_at and isinstance(answer, httpx.Response) and answer.status_code == 200
                   and not answer.json()["degraded"] for sent, _, answer in results):
                break
        stop.set()
        await loading
    bodies = answered(results)
    degraded = [b for b in bodies if b["degraded"]]
    assert degraded and all(b["stop_reason"] in ("policy_error", "policy_timeout") for b in degraded), degraded
    after = [body for (sent, _, _), body in zip(results, bodies, strict=True) if sent > ready_at]
    assert after and any(not b["degraded"] for b in after), after  # whole again, no searcher restart
    assert stack.pid("llm") != llm and alive_pid(stack.pid("llm"))
    assert {name: stack.pid(name) for name in others} == others and all(alive_pid(p) for p in others.values())
    print(json.dumps({"llm_crash": {"searches": len(bodies), "degraded": len(degraded)}}))


async def test_a_crashed_retriever_is_restarted_while_searches_wait_for_it(
        stack: Stack, questions: Iterator[str]) -> None:
    others = {name: stack.pid(name) for name in ("llm", "searcher", "generator", "judge")}
    retriever = stack.pid("retriever")
    port = stack.info["ports"]["retriever"]
    naive = {"mode": "naive", "retrieve_k": 5}
    async with httpx.AsyncClient(base_url=stack.info["searcher"], timeout=200) as client:
        asked = next(questions)
        first = await client.post("/search", json={"question": asked, **naive})
        assert first.status_code == 200 and not first.json()["cached"], first.text
        stop, results = asyncio.Event(), list[Result]()
        loading = asyncio.create_task(load(client, questions, naive, clients=4, until=stop, results=results))
        await asyncio.sleep(2)
        killed_at = time.monotonic()
        os.kill(retriever, signal.SIGSEGV)
        for _ in range(500):  # gone: its socket closed (the group leader shows as a zombie while its other
            if not alive_pid(retriever) and refuses_connections(port):  # threads, holding the files, still exit)
                break
            await asyncio.sleep(0.02)
        assert refuses_connections(port)
        # asked again while nothing can retrieve: the searcher cannot read the index's identity, so it does not
        # answer from its cache (a change acknowledged just before the crash could make that answer stale); the
        # search waits for the restarted retriever and gets the same documents
        again = await client.post("/search", json={"question": asked, **naive})
        assert again.status_code == 200 and not again.json()["cached"], again.text
        assert not again.json()["degraded"] and again.json()["documents"] == first.json()["documents"]
        await until_logged(stack, "retriever exited (rc=-11, SIGSEGV); restarting it in 1.0 s")
        await until_logged(stack, "retriever ready again")
        await asyncio.sleep(2)
        stop.set()
        await loading
    bodies = answered(results)
    assert not any(b["degraded"] for b in bodies)  # real documents, however late
    waited = [answered_at - sent for sent, answered_at, _ in results if sent < killed_at + 1 < answered_at]
    assert waited, "no search was in flight across the retriever's restart"
    assert stack.pid("retriever") != retriever and alive_pid(stack.pid("retriever"))
    assert {name: stack.pid(name) for name in others} == others
    print(json.dumps({"retriever_crash": {"searches": len(bodies), "across_the_restart": len(waited),
                                          "longest_wait_s": round(max(waited), 1)}}))
