"""The searcher against what a hostile or careless client (or policy) sends (issue 21): each error stays
with its own request. The real `RetrieverClient` + `ServiceRetriever` (merging concurrent retrievals)
reach a fake retriever app that validates requests as the real one does (query <= 2,048 characters)."""

from __future__ import annotations

import asyncio
import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plugsearch.common.clients import RetrieverClient
from plugsearch.common.errors import BadRequest
from plugsearch.common.http import ClientSettings
from plugsearch.common.schemas.retriever import MAX_QUERY_CHARS
from plugsearch.common.schemas.searcher import MAX_QUESTION_CHARS, SearchParams
from plugsearch.searcher.policy import ChatPolicy
from plugsearch.searcher.retrieval import ServiceRetriever
from plugsearch.searcher.serving import CACHE_NAMESPACE
from tests.api.test_searcher_api import Q, Stack, fake_retriever_app
from tests.asgi import app_client
from tests.support.chat_policy import run_search
from tests.unit.test_searcher_loop import ScriptedPolicy

ORDINARY = [f"who wrote book number {i}" for i in range(20)]


def long_question() -> str:
    words = "which of these many words " * (MAX_QUESTION_CHARS // 26 + 1)
    question = words[:MAX_QUESTION_CHARS - 10].strip() + "?"
    assert MAX_QUERY_CHARS < len(question) <= MAX_QUESTION_CHARS
    return question


async def test_a_long_question_among_ordinary_ones_fails_nobody() -> None:
    """5 rounds of 20 concurrent naive searches + one question over the retriever's query limit (but within
    the searcher's): every ordinary search answers 200, and so does the long one (its query is cut)."""
    stack = Stack()
    statuses: list[int] = []
    try:
        async with app_client(stack.app) as client:
            for _ in range(5):
                bodies = [{"question": q, "mode": "naive"} for q in ORDINARY] + [
                    {"question": long_question(), "mode": "naive"}]
                responses = await asyncio.gather(*(client.post("/search", json=b) for b in bodies))
                statuses += [r.status_code for r in responses[:-1]]
                long_answer = responses[-1]
                assert long_answer.status_code == 200, long_answer.text
                assert long_answer.json()["documents"]
    finally:
        await stack.aclose()
    assert statuses == [200] * 100
    sent = [q for request in stack.retriever_app.state.requests for q in request.queries]
    assert max(len(q) for q in sent) <= MAX_QUERY_CHARS
    assert any(len(request.queries) > 1 for request in stack.retriever_app.state.requests)  # really merged


async def test_the_retriever_client_refuses_bad_arguments_as_a_service_error() -> None:
    """Not pydantic's ValidationError: a merged batch treats a ServiceError as that caller's own refusal."""
    client = RetrieverClient(ClientSettings(url="http://retriever"),
                             transport=httpx.ASGITransport(app=fake_retriever_app()))
    try:
        for queries in (["x" * (MAX_QUERY_CHARS + 1)], ["a\x00b"], [" "]):
            try:
                await client.retrieve(queries, k=3)
            except BadRequest as exc:
                assert exc.param is not None and exc.param.startswith("queries")
            else:
                raise AssertionError(f"{queries!r} was sent")
    finally:
        await client.aclose()


def policy_saying(*outputs: str) -> ScriptedPolicy:
    return ScriptedPolicy(list(outputs) + ["<search_complete>True</search_complete>"] * 4)


async def test_a_policy_query_with_a_nul_is_searched_not_a_500() -> None:
    stack = Stack()
    try:
        async with stack.app.router.lifespan_context(stack.app):
            service = stack.app.state.service
            service.policy = ChatPolicy(policy_saying('<query>{"query": "a\\u0000b"}</query>'))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=stack.app), base_url="http://t") as client:
                response = await client.post("/search", json={"question": Q, "constrained": False})
    finally:
        await stack.aclose()
    assert response.status_code == 200, response.text
    body = response.json()
    assert not body["degraded"] and body["queries"] == ["a\x00b"]
    assert ["a b"] in [r.queries for r in stack.retriever_app.state.requests]


_NASTY_TEXT = st.one_of(st.text(max_size=60), st.sampled_from(["\x00", "a\x00b", "\ud800", " ", "", "\\u0000",
                                                                "x" * 5000, "word " * 1000, "9" * 40, "\n\t"]))
_PIECES = st.one_of(_NASTY_TEXT, st.sampled_from(["<query>", "</query>", "<important_info>", "</important_info>",
                                                  "<search_complete>", "</search_complete>", "True", "<search>",
                                                  "</search>", '{"query": ', '"', "}", "[", "]", "-1"]))
POLICY_OUTPUTS = st.one_of(
    st.lists(_PIECES, max_size=8).map("".join),
    _NASTY_TEXT.map(lambda q: f"<query>{json.dumps({'query': q})}</query>"),
    _NASTY_TEXT.map(lambda q: f"<query>{{\"query\": \"{q}\"}}</query>"),
    st.tuples(_NASTY_TEXT, _NASTY_TEXT).map(lambda qs: f"<plan>p</plan><search><query>{qs[0]}</query>"
                                                       f"<query>{qs[1]}</query></search>"),
    st.tuples(_NASTY_TEXT, _NASTY_TEXT).map(lambda t: f"<important_info>{t[0]}</important_info>"
                                                      f"<search_complete>{t[1]}</search_complete>"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(outputs=st.lists(POLICY_OUTPUTS, min_size=1, max_size=4), mode=st.sampled_from(["s3", "qagent"]))
def test_any_policy_output_ends_in_an_outcome_never_an_exception(outputs: list[str], mode: str) -> None:
    """Through the real client and merging retriever to an app that validates like the real retriever."""
    async def run() -> None:
        client = RetrieverClient(ClientSettings(url="http://retriever", max_retries=0),
                                 transport=httpx.ASGITransport(app=fake_retriever_app()))
        try:
            outcome = await run_search(Q, SearchParams(mode=mode, max_turns=3), policy=policy_saying(*outputs),
                                       retriever=ServiceRetriever(client))
        finally:
            await client.aclose()
        assert outcome.stop_reason  # an outcome (s3 may legitimately select nothing)
        json.dumps(outcome.model_dump(mode="json"))

    asyncio.run(run())


async def test_a_corrupt_cache_entry_is_a_miss_then_replaced() -> None:
    stack = Stack()
    try:
        async with app_client(stack.app) as client:
            first = (await client.post("/search", json={"question": Q, "mode": "naive"})).json()
            keys = [k for k in stack.cache.backend._data if f":{CACHE_NAMESPACE}:" in k]  # type: ignore[attr-defined]
            assert len(keys) == 1
            for garbage in (b"{not json", b'{"question": 3}', b"\xff\xfe", json.dumps([1, 2]).encode()):
                await stack.cache.backend.set(keys[0], garbage)
                response = await client.post("/search", json={"question": Q, "mode": "naive"})
                assert response.status_code == 200, response.text
                assert not response.json()["cached"] and response.json()["documents"] == first["documents"]
                again = await client.post("/search", json={"question": Q, "mode": "naive"})
                assert again.json()["cached"]  # the recomputed result replaced the corrupt entry
    finally:
        await stack.aclose()



# ------------------------------------------------------------------------------- cost bounds, rate limits
KEY, OTHER, INTERNAL = "public-key-1", "public-key-2", "internal-token-x"


def keyed(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_a_request_costing_more_than_the_bound_is_refused_before_any_work() -> None:
    stack = Stack(api_keys=f"{KEY},{OTHER}", internal_token=INTERNAL, rate_limit_per_s=0)
    heavy = {"question": Q, "retrieve_k": 50, "select_k": 50, "max_turns": 10}  # 11 x (1 + 50/4) + 11 x 3.1 = 182.6
    batch = {"items": [{"question": f"{Q} {i}"} for i in range(64)]}  # 64 x 16 = 1024
    try:
        async with app_client(stack.app) as client:
            for path, body in (("/search", heavy), ("/search/batch", batch)):
                refused = await client.post(path, json=body, headers=keyed(KEY))
                assert refused.status_code == 422, refused.text
                assert refused.json()["error"]["type"] == "cost_limit_exceeded"
            assert stack.llm.state.calls == 0 and stack.retriever_app.state.requests == []
            ordinary = await client.post("/search", json={"question": Q, "retrieve_k": 50, "select_k": 50},
                                         headers=keyed(KEY))
            assert ordinary.status_code == 200  # 4 x 13.5 + 4 x 3.1 = 66.4: within the bound
            trusted = await client.post("/search", json=heavy, headers=keyed(INTERNAL))
            assert trusted.status_code == 200  # the internal token (the trainer) is not bounded
    finally:
        await stack.aclose()


async def test_each_key_spends_its_own_budget_and_gets_retry_after() -> None:
    stack = Stack(api_keys=f"{KEY},{OTHER}", internal_token=INTERNAL, rate_limit_per_s=0.5,
                  rate_limit_burst=128, max_request_cost=128)
    naive = {"question": Q, "mode": "naive"}
    try:
        async with app_client(stack.app) as client:
            items = [{"question": f"{Q} {i}"} for i in range(7)] + [{"question": f"{Q} 7", "mode": "naive"}]
            spent = await client.post("/search/batch", json={"items": items}, headers=keyed(KEY))  # 7 x 16 + 1 of 128
            assert spent.status_code == 200
            over = await client.post("/search", json={"question": "another question"}, headers=keyed(KEY))
            assert over.status_code == 429 and over.json()["error"]["type"] == "rate_limited"
            assert int(over.headers["retry-after"]) >= 1  # (16 - 15) / 0.5 per second
            assert (await client.post("/search", json={**naive, "question": "cheap"}, headers=keyed(KEY))
                    ).status_code == 200  # 1 unit still fits
            assert (await client.post("/search", json={"question": "another question"}, headers=keyed(OTHER))
                    ).status_code == 200  # another key, another bucket
            hit = await client.post("/search", json={"question": f"{Q} 3"}, headers=keyed(KEY))
            assert hit.status_code == 200 and hit.json()["cached"]  # a cache hit costs nothing
            for _ in range(3):
                assert (await client.post("/search", json={"question": Q, "max_turns": 10},
                                          headers=keyed(INTERNAL))).status_code == 200  # never limited
    finally:
        await stack.aclose()


async def test_the_budget_is_shared_through_redis_by_every_replica(redis_url: str) -> None:
    replicas = [Stack(api_keys=KEY, rate_limit_per_s=0.1, rate_limit_burst=130, redis_url=redis_url)
                for _ in range(2)]
    try:
        async with app_client(replicas[0].app) as first, app_client(replicas[1].app) as second:
            body = {"items": [{"question": f"{Q} {i}"} for i in range(8)]}  # 128
            assert (await first.post("/search/batch", json=body, headers=keyed(KEY))).status_code == 200
            other = await second.post("/search", json={"question": "new question"}, headers=keyed(KEY))
            assert other.status_code == 429, other.text  # the other replica sees the spent bucket
    finally:
        for stack in replicas:
            await stack.aclose()
