"""Prices that follow the real work (issue 39): a retrieval costs what it returns (k) and, for dense and
hybrid, what the encoder reads (the query's tokens), in single searches, batches and the compact policy's
pool alike, from one function (`search_cost`); the per-request bound, the per-key budgets and the admission
limit use that price. The real searcher app in-process, the fake retriever and policy."""

from __future__ import annotations

import pytest

from plugsearch.common.admission import COST_STATE
from plugsearch.common.schemas.searcher import (
    Retrieval,
    SearchParams,
    SearchRequest,
    retrieval_cost,
    search_cost,
)
from tests.api.test_searcher_api import Q, Stack
from tests.asgi import app_client

KEY = "price-key-0123456"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = ("where was the author of the novel about the wild dog born " * 80)[:4096]
HEAVY_ITEM = {"mode": "naive", "method": "hybrid", "retrieve_k": 50, "question": LONG}
"""One item of the attacker's batches: 64 of them took 4.98 s of the retriever's work where 64 short BM25
searches took 0.31 s, at the same price (64 units)."""


def test_a_retrieval_costs_what_it_encodes_and_returns() -> None:
    short_bm25 = retrieval_cost(Retrieval("bm25", len(Q), 8))
    assert short_bm25 == pytest.approx(1.0)  # the default naive search
    assert retrieval_cost(Retrieval("bm25", 4096, 8)) == short_bm25  # BM25 encodes nothing
    assert retrieval_cost(Retrieval("bm25", len(Q), 50)) > short_bm25  # more documents returned
    dense_short, dense_long = retrieval_cost(Retrieval("dense", len(Q), 8)), retrieval_cost(Retrieval("dense", 4096, 8))
    assert short_bm25 < dense_short < dense_long
    assert retrieval_cost(Retrieval("hybrid", 4096, 50)) == pytest.approx(19.1)  # 0.6 + 50/20 + 512/32
    assert retrieval_cost(Retrieval("hybrid", 100_000, 50)) == retrieval_cost(Retrieval("hybrid", 4096, 50))  # cut
    assert retrieval_cost(Retrieval("dense", 40, 8, queries=3)) == pytest.approx(3 * retrieval_cost(
        Retrieval("dense", 40, 8)))


def test_one_price_for_every_policy() -> None:
    naive = SearchParams(mode="naive", method="hybrid", retrieve_k=50)
    assert search_cost(naive, 4096) == pytest.approx(19.1)
    s3 = SearchParams()
    # an LLM policy: its calls, (3 + 1) x (1 + 8/4) = 12, and its four retrievals
    assert search_cost(s3, len(Q)) == pytest.approx(12 + 4 * 1.0)
    # the compact policy acting in-process: the same retrievals, no LLM calls; its dense pool block encodes
    pooled = s3.model_copy(update={"pool_methods": ["bm25", "dense"]})
    assert search_cost(pooled, len(Q), llm_policy=False) == pytest.approx(
        retrieval_cost(Retrieval("bm25", len(Q), 8)) + retrieval_cost(Retrieval("dense", len(Q), 8))
        + 3 * retrieval_cost(Retrieval(None, len(Q) + 64, 8)))
    assert search_cost(pooled, 4096, llm_policy=False) > search_cost(pooled, len(Q), llm_policy=False)


async def test_the_heavy_batch_is_priced_by_its_work_and_refused_before_any() -> None:
    stack = Stack(api_keys=KEY)
    try:
        async with app_client(stack.app) as client:
            heavy = await client.post("/search/batch", headers=AUTH, json={"items": [HEAVY_ITEM] * 64})
            assert heavy.status_code == 422, heavy.text  # 64 x 19.1 = 1,222 units, over the 128 of a request
            error = heavy.json()["error"]
            assert error["type"] == "cost_limit_exceeded" and "1222" in error["message"], error
            assert stack.retriever_app.state.requests == []
            light = await client.post("/search/batch", headers=AUTH, json={"items": [
                {"mode": "naive", "question": f"{Q} {i}"} for i in range(64)]})
            assert light.status_code == 200, light.text  # 64 short BM25 searches: 64 units
            fitting = await client.post("/search/batch", headers=AUTH, json={"items": [HEAVY_ITEM] * 6})
            assert fitting.status_code == 200, fitting.text  # 6 x 19.1 = 114.6
    finally:
        await stack.aclose()


async def test_the_budget_and_the_admission_limit_spend_that_price() -> None:
    stack = Stack(api_keys=KEY, rate_limit_per_s=0.01, rate_limit_burst=128, max_request_cost=128)
    service_costs: list[float] = []
    try:  # the bucket: 128 units, refilled at 0.01 a second
        async with app_client(stack.app) as client:
            service = stack.app.state.service
            service_costs.append((await service.prepare(SearchRequest(**HEAVY_ITEM))).cost)  # type: ignore[arg-type]
            statuses = []
            for i in range(7):  # 6 x 19.1 = 114.6 of the 128 units of the key's bucket; the 7th does not fit
                response = await client.post("/search", headers=AUTH, json={**HEAVY_ITEM, "question": f"{LONG[:4000]} {i}"})
                statuses.append(response.status_code)
            assert statuses == [200] * 6 + [429], statuses
            cheap = await client.post("/search", headers=AUTH, json={"question": Q, "mode": "naive"})
            assert cheap.status_code == 200  # 1 unit still fits
    finally:
        await stack.aclose()
    assert service_costs == [pytest.approx(19.1)]


async def test_the_guard_learns_latency_per_unit_of_that_price() -> None:
    seen: list[float] = []
    stack = Stack(api_keys=KEY)
    guard_leave = None
    try:
        async with app_client(stack.app) as client:
            await client.get("/health/live")  # the middleware stack is built on the first request
            middleware = stack.app.middleware_stack
            while middleware is not None and not hasattr(middleware, "admission"):
                middleware = getattr(middleware, "app", None)
            assert middleware is not None
            admission = middleware.admission
            guard_leave = admission.leave

            def leave(entered: tuple[int, int], status: int, seconds: float, cost: float, caller: str = "") -> None:
                seen.append(cost)
                guard_leave(entered, status, seconds, cost, caller)

            admission.leave = leave
            await client.post("/search", headers=AUTH, json=HEAVY_ITEM)
            await client.post("/search/batch", headers=AUTH, json={"items": [HEAVY_ITEM] * 2})
    finally:
        await stack.aclose()
    assert seen == [pytest.approx(19.1), pytest.approx(38.2)]
    assert COST_STATE == "plugsearch_cost"


async def test_a_key_that_keeps_sending_refused_requests_spends_its_budget_and_meets_the_door() -> None:
    """A refusal is work too (reading 64 x 4 KB, validating, pricing): each costs its key a unit, and a key that
    cannot afford one more is refused before its body is read."""
    stack = Stack(api_keys=f"{KEY},other-key-0123456", rate_limit_per_s=0.01, rate_limit_burst=130,
                  max_request_cost=128)
    heavy = {"items": [HEAVY_ITEM] * 64}
    try:
        async with app_client(stack.app) as client:
            spend = await client.post("/search/batch", headers=AUTH, json={"items": [HEAVY_ITEM] * 6})
            assert spend.status_code == 200  # 114.6 of 130
            statuses = [(await client.post("/search/batch", headers=AUTH, json=heavy)).status_code for _ in range(18)]
            # 15.4 units left: 15 refusals spend 15, the 16th finds less than one (its answer is still the 422)
            assert statuses[:16] == [422] * 16, statuses
            assert set(statuses[16:]) == {429}, statuses  # broke: refused at the door
            door = await client.post("/search", headers={**AUTH, "content-type": "application/json"},
                                     content=b"{not json")
            assert door.status_code == 429, door.text  # answered before the (invalid) body was read
            assert door.json()["error"]["type"] == "rate_limited" and int(door.headers["retry-after"]) >= 1
            other = await client.post("/search", headers={"Authorization": "Bearer other-key-0123456"},
                                      json={"question": Q, "mode": "naive"})
            assert other.status_code == 200  # another key, another budget
    finally:
        await stack.aclose()
