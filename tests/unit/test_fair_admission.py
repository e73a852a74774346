"""Admission shared fairly (issues 31, 39): the adaptive limit keeps its documented floor under any latency,
one caller at the limit cannot keep another out, and the LLM's slots are shared between keys: never more
held than there are, waiting requests served across keys in turn."""

from __future__ import annotations

import asyncio

import pytest

from plugsearch.common.admission import AdaptiveLimit, FairAdmission, FairShare
from plugsearch.stack.specs import StackOptions, build_specs


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_adaptive_limit_never_goes_below_its_floor() -> None:
    clock = Clock()
    limit = AdaptiveLimit(256, min_limit=4, clock=clock)
    assert limit.floor == 32
    for window in range(200):  # latency grows without end while requests press against the limit
        clock.now += 1.0
        for _ in range(20):
            limit.admits(limit.current + 5)
            limit.observe(0.01 * (window + 1) ** 2, in_flight=limit.current - 1)
    assert limit.current == 32


def test_a_caller_at_the_limit_does_not_keep_another_out() -> None:
    limit = AdaptiveLimit(64, min_limit=4, adaptive=False)
    limit.limit = 8.0
    fair = FairAdmission(limit)
    for _ in range(8):
        assert fair.admits("flood")
        fair.enter("flood")
    assert not fair.admits("flood")  # the limit is reached
    assert fair.admits("ordinary")  # under its share (8 / 2 callers)
    for _ in range(4):
        fair.enter("ordinary")
    assert not fair.admits("ordinary") and not fair.admits("flood")
    for _ in range(4):
        fair.leave("flood")
    assert not fair.admits("flood")  # still over its share while "ordinary" is in flight
    for _ in range(4):
        fair.leave("ordinary")
    assert fair.admits("flood") and fair.by_caller == {"flood": 4} and fair.in_flight == 4


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_llm_slots_are_shared_between_keys_and_never_oversubscribed() -> None:
    share = FairShare(4, initial_hold_s=3.0)
    for _ in range(4):
        assert await share.acquire("a") == 0.0  # alone: every slot
    assert await share.acquire("a", timeout_s=5) >= 1.0  # over its share: refused at once, not queued
    b = [asyncio.create_task(share.acquire("b")) for _ in range(2)]  # within its share (4 / 2): they wait
    await settle()
    assert not any(t.done() for t in b) and share.free == 0 and share.waiting("b") == 2
    assert share.try_acquire("b") > 0 and await share.acquire("b", timeout_s=5) >= 1.0  # a third: over its share
    share.release("a", 10.0)
    assert share.hold_s > 3.0
    await settle()
    assert b[0].done() and b[0].result() == 0.0 and not b[1].done() and share.held == {"a": 3, "b": 1}
    assert share.try_acquire("a") > 0  # "a" holds more than its share now: nothing more for it
    share.release("a", 1.0)
    await settle()
    assert b[1].result() == 0.0 and share.held == {"a": 2, "b": 2} and share.free == 0


async def test_waiting_requests_are_served_across_keys_in_turn() -> None:
    share = FairShare(1)
    granted: list[str] = []

    async def ask(caller: str) -> None:
        assert await share.acquire(caller) == 0.0
        granted.append(caller)

    assert await share.acquire("a") == 0.0
    tasks = [asyncio.create_task(ask("b"))]
    await settle()
    tasks.append(asyncio.create_task(ask("c")))
    await settle()
    assert granted == [] and share.held == {"a": 1}  # one slot: nobody else is sent to the LLM meanwhile
    share.release("a", 1.0)
    await settle()
    tasks.append(asyncio.create_task(ask("a")))  # "a" asks again while "c" still waits: it comes after "c"
    await settle()
    share.release("b", 1.0)
    await settle()
    tasks.append(asyncio.create_task(ask("b")))
    await settle()
    share.release("c", 1.0)
    await settle()
    share.release("a", 1.0)
    await asyncio.gather(*tasks)
    assert granted == ["b", "c", "a", "b"]


async def test_a_request_that_leaves_or_times_out_gives_its_turn_away() -> None:
    share = FairShare(1, initial_hold_s=2.0)
    assert await share.acquire("a") == 0.0
    assert await share.acquire("b", timeout_s=0.05) >= 1.0  # no turn within its wait: retry later
    assert share.waiting() == 0
    leaving = asyncio.create_task(share.acquire("b"))
    staying = asyncio.create_task(share.acquire("c"))
    await settle()
    leaving.cancel()
    await settle()
    assert share.waiting() == 1
    share.release("a", 1.0)
    assert await staying == 0.0 and share.held == {"c": 1}
    # granted at the moment its caller left: the slot is handed on, not kept
    late = asyncio.create_task(share.acquire("d"))
    await settle()
    share.release("c", 1.0)
    late.cancel()
    with pytest.raises(asyncio.CancelledError):
        await late
    assert share.held == {} and share.free == 1


def stack_options(**fields: object) -> StackOptions:
    from pathlib import Path

    ports = {"searcher": 1, "retriever": 2, "generator": 3, "judge": 4, "llm": 5, "redis": 6, "policy": 7}
    return StackOptions(ports=ports, corpus=Path("c.jsonl"), index_dir=Path("i"), redis=False, **fields)  # type: ignore[arg-type]


def searcher_env(options: StackOptions, environ: dict[str, str]) -> dict[str, str]:
    spec = next(s for s in build_specs(options, environ=environ) if s.name == "searcher")
    return dict(spec.env)


def test_stack_wires_the_chat_proxy_to_its_llm_with_its_key() -> None:
    options = stack_options(chat=True)
    env = searcher_env(options, {})
    assert env["SEARCHER_CHAT__ANSWER__BASE_URL"] == "http://127.0.0.1:5/v1"
    assert env["SEARCHER_CHAT__ANSWER__API_KEY"] == options.llm_api_key
    assert env["SEARCHER_CHAT__ANSWER__MODEL"] == "smollm2-135m-instruct" and env["SEARCHER_LLM_SLOTS"] == "1"
    # the documented set-up by hand (the URL of the stack's own llama.cpp in the environment): its key is given
    plain = stack_options()
    env = searcher_env(plain, {"SEARCHER_CHAT__ANSWER__BASE_URL": "http://localhost:5/v1/"})
    assert env["SEARCHER_CHAT__ANSWER__API_KEY"] == plain.llm_api_key
    # ... but never to another URL, nor over a key set by hand, nor without a proxy
    for environ in ({"SEARCHER_CHAT__ANSWER__BASE_URL": "http://example.org/v1"},
                    {"SEARCHER_CHAT__ANSWER__BASE_URL": "http://127.0.0.1:5/v1",
                     "SEARCHER_CHAT__ANSWER__API_KEY": "own"}, {}):
        assert "SEARCHER_CHAT__ANSWER__API_KEY" not in searcher_env(plain, environ)
    external = stack_options(chat=True, llm_url="http://gpu:8000/v1")
    env = searcher_env(external, {})
    assert env["SEARCHER_CHAT__ANSWER__BASE_URL"] == "http://gpu:8000/v1"
    assert "SEARCHER_CHAT__ANSWER__API_KEY" not in env and "SEARCHER_LLM_SLOTS" not in env
