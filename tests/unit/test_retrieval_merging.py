"""`ServiceRetriever` merges concurrent retrievals into one retriever request, and hands every caller
exactly its own results or its own error."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from plugsearch.common.errors import BadRequest, UpstreamTimeout, ValidationFailed
from plugsearch.common.http import UpstreamUnavailable
from plugsearch.common.schemas.base import Document
from plugsearch.common.schemas.retriever import RetrieveResponse
from plugsearch.searcher.retrieval import RetrieverRefused, ServiceRetriever

BAD = "refuse me"


class FakeClient:
    """Records each request; answers one document per query whose id names the query and k. With `hold`,
    a request is answered only once `release` is set (`sent` says one arrived)."""

    def __init__(self, *, fail: Exception | None = None, hold: bool = False, knows_methods: bool = True,
                 serves: tuple[str | None, ...] = (None, "bm25", "dense")) -> None:
        self.calls: list[tuple[list[str], int, Any]] = []
        self.fail = fail
        self.knows_methods = knows_methods
        self.serves = serves
        self.sent = asyncio.Event()
        self.release = asyncio.Event()
        if not hold:
            self.release.set()

    async def retrieve(self, queries: list[str], k: int = 10, method: Any = None, *,
                       methods: list[Any] | None = None) -> RetrieveResponse:
        self.calls.append((list(queries), k, method if methods is None else tuple(methods)))
        self.sent.set()
        await asyncio.sleep(0)
        await self.release.wait()
        if self.fail is not None:
            raise self.fail
        if methods is not None and not self.knows_methods:  # a retriever from before `methods`
            raise ValidationFailed("retriever: methods: Extra inputs are not permitted", param="methods")
        if methods is None and method not in self.serves:
            raise BadRequest(f"retriever: method {method!r} is not served here", param="method")
        if methods is not None and not set(methods) <= set(self.serves):
            raise BadRequest("retriever: a method is not served here", param="methods")
        if BAD in queries:
            raise BadRequest("retriever: query too long")  # what decode_error gives for a 400
        each = methods if methods is not None else [method] * len(queries)
        return RetrieveResponse.model_construct(
            results=[[Document(id=f"{q}|{k}|{m}", title="t", text="x", score=1.0)] for q, m in zip(queries, each, strict=True)])


def ids(results: list[list[Document]]) -> list[str]:
    return [docs[0].id for docs in results]


async def test_concurrent_calls_go_out_as_one_request_and_each_caller_gets_its_own_slice() -> None:
    client = FakeClient()
    retriever = ServiceRetriever(client, max_batch=64)  # type: ignore[arg-type]
    batches = [["a"], ["b", "c"], ["d"]]
    results = await asyncio.gather(*(retriever.retrieve(qs, 8, "bm25") for qs in batches))
    assert client.calls == [(["a", "b", "c", "d"], 8, "bm25")]
    assert [ids(r) for r in results] == [["a|8|bm25"], ["b|8|bm25", "c|8|bm25"], ["d|8|bm25"]]


async def test_calls_with_another_k_are_separate_requests_other_methods_go_along_one_per_query() -> None:
    client = FakeClient()
    retriever = ServiceRetriever(client)  # type: ignore[arg-type]
    results = await asyncio.gather(retriever.retrieve(["a"], 8, "bm25"), retriever.retrieve(["b"], 3, "bm25"),
                                   retriever.retrieve(["a"], 8, "dense"), retriever.retrieve(["d"], 8, "bm25"))
    assert sorted(client.calls, key=str) == sorted([(["a", "a", "d"], 8, ("bm25", "dense", "bm25")),
                                                    (["b"], 3, "bm25")], key=str)
    assert [ids(r) for r in results] == [["a|8|bm25"], ["b|3|bm25"], ["a|8|dense"], ["d|8|bm25"]]


async def test_without_mixed_methods_each_method_is_its_own_request() -> None:
    client = FakeClient()
    retriever = ServiceRetriever(client, mixed_methods=False)  # type: ignore[arg-type]
    results = await asyncio.gather(retriever.retrieve(["a"], 8, "bm25"), retriever.retrieve(["c"], 8, "dense"),
                                   retriever.retrieve(["d"], 8, "bm25"))
    assert sorted(client.calls, key=str) == sorted([(["a", "d"], 8, "bm25"), (["c"], 8, "dense")], key=str)
    assert [ids(r) for r in results] == [["a|8|bm25"], ["c|8|dense"], ["d|8|bm25"]]


async def test_a_retriever_that_refuses_methods_gets_one_request_per_method_from_then_on() -> None:
    client = FakeClient(knows_methods=False)
    retriever = ServiceRetriever(client)  # type: ignore[arg-type]
    results = await asyncio.gather(retriever.retrieve(["q"], 8, "bm25"), retriever.retrieve(["q"], 8, "dense"))
    assert [ids(r) for r in results] == [["q|8|bm25"], ["q|8|dense"]]
    assert client.calls[0] == (["q", "q"], 8, ("bm25", "dense")) and not retriever.mixed_methods
    assert sorted(client.calls[1:], key=str) == [(["q"], 8, "bm25"), (["q"], 8, "dense")]
    client.calls.clear()
    await asyncio.gather(retriever.retrieve(["r"], 8, "bm25"), retriever.retrieve(["r"], 8, "dense"))
    assert sorted(client.calls, key=str) == [(["r"], 8, "bm25"), (["r"], 8, "dense")]  # no second try


async def test_an_unserved_method_fails_only_its_caller_with_the_retrievers_400() -> None:
    client = FakeClient(serves=(None, "bm25"))
    retriever = ServiceRetriever(client)  # type: ignore[arg-type]
    results = await asyncio.gather(retriever.retrieve(["q"], 8, "bm25"), retriever.retrieve(["q"], 8, "dense"),
                                   return_exceptions=True)
    assert ids(results[0]) == ["q|8|bm25"]  # type: ignore[arg-type]
    assert isinstance(results[1], BadRequest) and results[1].param == "method"
    assert retriever.mixed_methods  # a method not served is no reason to stop merging


async def test_a_full_batch_is_sent_and_the_rest_start_another() -> None:
    client = FakeClient()
    retriever = ServiceRetriever(client, max_batch=4)  # type: ignore[arg-type]
    results = await asyncio.gather(*(retriever.retrieve([f"q{i}", f"r{i}"], 5, None) for i in range(5)))
    assert [len(qs) for qs, _, _ in client.calls] == [4, 4, 2]
    assert [ids(r) for r in results] == [[f"q{i}|5|None", f"r{i}|5|None"] for i in range(5)]


async def test_a_lone_call_is_not_held_back_and_max_batch_1_never_merges() -> None:
    client = FakeClient()
    retriever = ServiceRetriever(client, max_batch=1)  # type: ignore[arg-type]
    await asyncio.gather(retriever.retrieve(["a"], 8, None), retriever.retrieve(["b"], 8, None))
    assert client.calls == [(["a"], 8, None), (["b"], 8, None)]
    alone = ServiceRetriever(FakeClient())  # type: ignore[arg-type]
    assert ids(await asyncio.wait_for(alone.retrieve(["x"], 2, None), timeout=1)) == ["x|2|None"]


async def test_a_refused_merged_request_is_resent_per_caller_so_only_the_bad_caller_fails() -> None:
    client = FakeClient()
    retriever = ServiceRetriever(client)  # type: ignore[arg-type]
    results = await asyncio.gather(retriever.retrieve(["a"], 8, None), retriever.retrieve([BAD], 8, None),
                                   retriever.retrieve(["b"], 8, None), return_exceptions=True)
    assert ids(results[0]) == ["a|8|None"] and ids(results[2]) == ["b|8|None"]  # type: ignore[arg-type]
    assert isinstance(results[1], RetrieverRefused) and results[1].status == 502
    assert client.calls[0][0] == ["a", BAD, "b"] and sorted(c[0][0] for c in client.calls[1:]) == ["a", "b", BAD]


async def test_an_upstream_failure_reaches_every_caller_of_the_batch() -> None:
    client = FakeClient(fail=UpstreamTimeout("retriever timed out"))
    retriever = ServiceRetriever(client)  # type: ignore[arg-type]
    results = await asyncio.gather(retriever.retrieve(["a"], 8, None), retriever.retrieve(["b"], 8, None),
                                   return_exceptions=True)
    assert all(isinstance(r, UpstreamTimeout) for r in results) and len(client.calls) == 1


async def test_a_cancelled_caller_does_not_disturb_the_others() -> None:
    client = FakeClient(hold=True)
    retriever = ServiceRetriever(client)  # type: ignore[arg-type]
    first = asyncio.create_task(retriever.retrieve(["a"], 8, None))
    second = asyncio.create_task(retriever.retrieve(["b"], 8, None))
    await client.sent.wait()  # the merged request is on its way
    first.cancel()
    client.release.set()
    assert ids(await second) == ["b|8|None"]
    with pytest.raises(asyncio.CancelledError):
        await first
    assert client.calls == [(["a", "b"], 8, None)]


async def test_an_answer_with_the_wrong_number_of_lists_is_an_upstream_error() -> None:
    class Short(FakeClient):
        async def retrieve(self, queries: list[str], k: int = 10, method: Any = None, *,
                           methods: list[Any] | None = None) -> RetrieveResponse:
            response = await super().retrieve(queries, k, method, methods=methods)
            return RetrieveResponse.model_construct(results=response.results[:-1])

    retriever = ServiceRetriever(Short())  # type: ignore[arg-type]
    results = await asyncio.gather(retriever.retrieve(["a"], 8, None), retriever.retrieve(["b"], 8, None),
                                   return_exceptions=True)
    assert all(isinstance(r, Exception) and "result lists" in str(r) for r in results)


class RestartingClient(FakeClient):
    """Unreachable (what `ServiceClient` raises for refused connections, a 503 while the index loads, an open
    breaker) for its first `down` calls, then answering."""

    def __init__(self, down: int) -> None:
        super().__init__()
        self.down = down

    async def retrieve(self, queries: list[str], k: int = 10, method: Any = None) -> RetrieveResponse:
        if len(self.calls) < self.down:
            self.calls.append((list(queries), k, method))
            raise UpstreamUnavailable("retriever unreachable: ConnectError", retry_after=2.0)
        return await super().retrieve(queries, k, method)


async def test_a_retriever_that_is_restarting_is_waited_for_within_wait_s() -> None:
    client = RestartingClient(down=3)
    retriever = ServiceRetriever(client, wait_s=30.0)  # type: ignore[arg-type]
    results = await asyncio.gather(retriever.retrieve(["a"], 8, None), retriever.retrieve(["b"], 8, None))
    assert [ids(r) for r in results] == [["a|8|None"], ["b|8|None"]]
    assert len(client.calls) == 4  # three unanswered tries of the merged request, then its answer
    with pytest.raises(UpstreamUnavailable):  # no wait: the first failure is the caller's 503
        await ServiceRetriever(RestartingClient(down=1)).retrieve(["a"], 8, None)  # type: ignore[arg-type]
    gone = RestartingClient(down=1000)
    with pytest.raises(UpstreamUnavailable):  # a retriever that stays away: the failure after wait_s
        await ServiceRetriever(gone, wait_s=0.6).retrieve(["a"], 8, None)  # type: ignore[arg-type]
    assert 2 <= len(gone.calls) <= 4
