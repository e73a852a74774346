"""The searcher's corpus check against the real retriever app (bm25s + MiniLM over ~300 real passages, in-process
over ASGI): the check samples the served corpus through `POST /passages/sample`, measures the policy against
naive BM25 top-k, and a policy that loses is not served: s3 searches answer with naive BM25's documents, say so
(`fallback`, `stop_reason` naive, no `policy_model`), are cached apart from the policy's; `SEARCHER_CORPUS_CHECK=off`
serves the policy anyway; `/version` of the searcher app shows the verdict."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from plugsearch.common.cache import MemoryCache, ResultCache
from plugsearch.common.clients import RetrieverClient
from plugsearch.common.http import ClientSettings
from plugsearch.common.schemas.searcher import SearchRequest
from plugsearch.retriever.api import create_app as retriever_app
from plugsearch.retriever.settings import RetrieverSettings
from plugsearch.searcher.api import sampler
from plugsearch.searcher.compact import CompactPolicy
from plugsearch.searcher.corpus_check import CorpusGate
from plugsearch.searcher.env import Action, SearchEnv
from plugsearch.searcher.index_identity import IndexIdentity
from plugsearch.searcher.retrieval import ServiceRetriever
from plugsearch.searcher.serving import SearchService
from plugsearch.searcher.settings import SearcherSettings
from plugsearch.searcher.trained import COMPACT_DIR
from tests.api.test_retriever_api import tiny, wait_ready  # noqa: F401 - tiny: the retriever's fixture
from tests.asgi import app_client


@pytest.fixture()
async def retriever(tiny: RetrieverSettings) -> AsyncIterator[RetrieverClient]:  # noqa: F811
    app = retriever_app(tiny)
    async with app_client(app) as http:
        await wait_ready(http)
        client = RetrieverClient(ClientSettings(url="http://retriever", max_retries=0, breaker_failures=100),
                                 transport=httpx.ASGITransport(app=app))
        try:
            yield client
        finally:
            await client.aclose()


class WorstOfPool(CompactPolicy):
    """The shipped policy's weights, but it returns the pool's last documents: far below naive BM25."""

    async def act(self, env: SearchEnv) -> Action:
        blocks = env.blocks
        last = [(0, p) for p in range(len(blocks[0].documents), 0, -1)][:env.params.select_k]
        return Action("complete", selected=tuple(last))


def service(policy: CompactPolicy, client: RetrieverClient, *, check: bool = True) -> SearchService:
    retriever = ServiceRetriever(client)
    gate = CorpusGate(policy, retriever, sampler(client), questions=60, manifest=policy.manifest) if check else None
    return SearchService(SearcherSettings(), policy=policy, retriever=retriever,
                         cache=ResultCache(MemoryCache(), name="search"),
                         index_identity=IndexIdentity(client, ttl_s=0), corpus_gate=gate)


QUESTION = "who wrote the novel the lord of the rings"


async def test_a_policy_that_loses_on_the_corpus_is_replaced_by_naive_bm25_and_says_so(
        retriever: RetrieverClient) -> None:
    shipped = CompactPolicy.load(COMPACT_DIR)
    bad = WorstOfPool(shipped.weights, name="worst", digest="0" * 64, manifest=shipped.manifest)
    svc = service(bad, retriever)
    assert svc.corpus_gate is not None
    svc.start_corpus_check()
    pending = await svc.search(await svc.prepare(SearchRequest(question=QUESTION)))  # the check runs: naive meanwhile
    assert pending.fallback is not None and "running" in pending.fallback
    await svc.corpus_checked()
    result = svc.corpus_gate.last
    assert result is not None and result.decision == "naive" and result.questions >= 30
    assert result.policy_recall < result.naive_recall and result.interval[1] < 0
    response = await svc.search(await svc.prepare(SearchRequest(question=QUESTION)))
    naive = (await retriever.retrieve([QUESTION], k=3, method="bm25")).results[0]
    assert response.mode == "s3" and response.stop_reason == "naive" and response.policy_model is None
    assert response.fallback is not None and "naive BM25 top-3 serves" in response.fallback
    assert [d.id for d in response.documents] == [d.id for d in naive]
    cached = await svc.search(await svc.prepare(SearchRequest(question=QUESTION)))
    assert cached.cached and cached.fallback == response.fallback
    described = svc.corpus_gate.describe()
    assert described["state"] == "done" and described["last"]["decision"] == "naive"

    unchecked = service(bad, retriever, check=False)  # SEARCHER_CORPUS_CHECK=off: the policy serves, unchecked
    served = await unchecked.search(await unchecked.prepare(SearchRequest(question=QUESTION)))
    assert served.fallback is None and served.policy_model == bad.model and served.stop_reason == "complete"


async def test_the_shipped_policy_is_checked_and_served_when_it_holds_up(retriever: RetrieverClient) -> None:
    shipped = CompactPolicy.load(COMPACT_DIR)
    svc = service(shipped, retriever)
    assert svc.corpus_gate is not None
    svc.start_corpus_check()
    await svc.corpus_checked()
    result = svc.corpus_gate.last
    assert result is not None and result.questions >= 30
    response = await svc.search(await svc.prepare(SearchRequest(question=QUESTION)))
    if result.decision == "policy":
        assert response.fallback is None and response.policy_model == shipped.model
    else:
        assert response.fallback == result.reason and response.policy_model is None


class UnknownIndex(IndexIdentity):
    """A retriever whose `/version` (and `/index`) has not said what it serves yet."""

    async def current(self) -> str | None:
        return None

    async def fresh(self) -> str | None:
        return None


async def test_before_the_retriever_says_what_it_serves_naive_answers(retriever: RetrieverClient) -> None:
    shipped = CompactPolicy.load(COMPACT_DIR)
    svc = service(shipped, retriever)
    svc.index_identity = UnknownIndex(retriever)
    response = await svc.search(await svc.prepare(SearchRequest(question=QUESTION)))
    assert response.fallback is not None and "has not said which index" in response.fallback
    assert response.policy_model is None and response.stop_reason == "naive" and len(response.documents) == 3
