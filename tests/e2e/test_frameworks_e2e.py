"""Each RAG framework's own retriever interface, with the real framework package, against real processes:
the retriever (bm25s over the shared corpus), a scripted policy (`tests.support.fake_llm` +
`tests.support.fake_policy`: valid s3 actions, instantly) and the searcher with an API key.

LangChain (`invoke` / `ainvoke`), LlamaIndex (`retrieve` / `aretrieve`), Haystack (the component's `run` /
`run_async`, in a `Pipeline`, serialized) and DSPy (`dspy.Retrieve`'s call / `acall`): the framework's own
documents with text, title, id, score and the search's metadata; the search options reach the searcher;
a 4xx (a retrieval method the retriever does not serve, a wrong key) raises the framework's kind of error
with the envelope's message and status.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.services import (
    ensure_bm25_index,
    retriever_process,
    scripted_policy_process,
    searcher_process,
)

pytestmark = pytest.mark.e2e

KEY = "e2e-frameworks-key"
QUESTION = "who wrote the novel the call of the wild"
SEARCH_KEYS = {"mode", "queries", "policy", "degraded", "degraded_reason", "stop_reason", "cached"}

# no framework may phone home from a test (Haystack's telemetry, LiteLLM's model price list)
os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


@pytest.fixture(scope="module")
def searcher_url(data_dir: Path, var_dir: Path) -> Iterator[str]:
    corpus = data_dir / "corpus" / "combined.jsonl"
    logs = var_dir / "logs"
    with retriever_process(corpus, ensure_bm25_index(corpus, var_dir), logs / "frameworks_retriever.log") as r, \
            scripted_policy_process(logs / "frameworks_policy.log") as policy, \
            searcher_process(r, policy, logs / "frameworks_searcher.log", policy_model="scripted-policy",
                             extra={"api_keys": KEY}) as url:
        yield url


def check_search(metadata: dict[str, Any], mode: str) -> None:
    assert SEARCH_KEYS <= set(metadata)
    assert metadata["mode"] == mode and metadata["degraded"] is False
    if mode == "s3":
        assert metadata["policy"] == "scripted-policy" and metadata["queries"]
        assert metadata["stop_reason"] == "complete"
    else:
        assert metadata["policy"] is None and metadata["queries"] == [] and metadata["stop_reason"] == "naive"


def check_error(error: Any, status: int, words: str, param: str | None = None) -> None:
    assert error.status == status and words in str(error)
    assert error.param == param
    assert error.__cause__ is not None  # the client's ServiceError, kept


# ------------------------------------------------------------------------------------------------ LangChain
def test_langchain_retriever(searcher_url: str) -> None:
    from langchain_core.documents import Document
    from langchain_core.retrievers import BaseRetriever

    from plugsearch.integrations.langchain import PlugsearchRetriever, PlugsearchRetrieverError

    retriever = PlugsearchRetriever(base_url=searcher_url, api_key=KEY, mode="s3", max_turns=2)
    try:
        assert isinstance(retriever, BaseRetriever)
        docs = retriever.invoke(QUESTION)
        assert docs and all(isinstance(d, Document) for d in docs)
        first = docs[0]
        assert first.id == first.metadata["id"] and first.page_content and first.metadata["title"]
        assert isinstance(first.metadata["score"], float)
        check_search(first.metadata, "s3")
        assert len(first.metadata["queries"]) <= 2  # the budget reached the searcher
        naive = retriever.invoke(QUESTION, mode="naive", retrieve_k=3)  # per call, as keywords
        assert len(naive) == 3
        check_search(naive[0].metadata, "naive")
        with pytest.raises(PlugsearchRetrieverError) as caught:
            retriever.invoke(QUESTION, method="dense")
        check_error(caught.value, 400, "dense", param="method")
        assert caught.value.error_type == "bad_request"
    finally:
        retriever.close()
    anonymous = PlugsearchRetriever(base_url=searcher_url, api_key="not-the-key")
    with pytest.raises(PlugsearchRetrieverError) as refused:
        anonymous.invoke(QUESTION)
    check_error(refused.value, 401, "missing or invalid API key")
    anonymous.close()


async def test_langchain_retriever_async(searcher_url: str) -> None:
    from plugsearch.integrations.langchain import PlugsearchRetriever, PlugsearchRetrieverError

    retriever = PlugsearchRetriever(base_url=searcher_url, api_key=KEY, mode="naive", retrieve_k=4)
    try:
        docs = await retriever.ainvoke(QUESTION)
        assert len(docs) == 4
        check_search(docs[0].metadata, "naive")
        with pytest.raises(PlugsearchRetrieverError) as caught:
            await retriever.ainvoke(QUESTION, method="dense")
        check_error(caught.value, 400, "dense", param="method")
    finally:
        await retriever.aclose()


# ----------------------------------------------------------------------------------------------- LlamaIndex
def test_llamaindex_retriever(searcher_url: str) -> None:
    from llama_index.core.llms import MockLLM
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode

    from plugsearch.integrations.llamaindex import PlugsearchRetriever, PlugsearchRetrieverError

    retriever = PlugsearchRetriever(searcher_url, api_key=KEY, mode="s3")
    try:
        assert isinstance(retriever, BaseRetriever)
        nodes = retriever.retrieve(QUESTION)
        assert nodes and all(isinstance(n, NodeWithScore) and isinstance(n.node, TextNode) for n in nodes)
        first = nodes[0]
        assert first.node.node_id == first.node.metadata["id"] and first.node.text
        assert first.score == first.node.metadata["score"]
        check_search(first.node.metadata, "s3")
        # what an LLM sees of a node: the title and the text, not the search's bookkeeping
        seen = first.node.get_content(metadata_mode=MetadataMode.LLM)
        assert first.node.metadata["title"] in seen and "stop_reason" not in seen
        # in a query engine, as docs/integrations.md shows it (an LLM that echoes its prompt stands in for yours)
        engine = RetrieverQueryEngine.from_args(retriever, llm=MockLLM())
        answer = engine.query(QUESTION)
        assert [n.node.node_id for n in answer.source_nodes] == [n.node.node_id for n in nodes]
        assert first.node.text[:40] in str(answer)
        bad = PlugsearchRetriever(searcher_url, api_key=KEY, mode="naive", method="dense")
        with pytest.raises(PlugsearchRetrieverError) as caught:
            bad.retrieve(QUESTION)
        check_error(caught.value, 400, "dense", param="method")
        bad.close()
    finally:
        retriever.close()


async def test_llamaindex_retriever_async(searcher_url: str) -> None:
    from plugsearch.integrations.llamaindex import PlugsearchRetriever

    retriever = PlugsearchRetriever(searcher_url, api_key=KEY, mode="naive", retrieve_k=2)
    try:
        nodes = await retriever.aretrieve(QUESTION)
        assert len(nodes) == 2
        check_search(nodes[0].node.metadata, "naive")
    finally:
        await retriever.aclose()


# -------------------------------------------------------------------------------------------------- Haystack
def test_haystack_component_in_a_pipeline(searcher_url: str) -> None:
    from haystack import Document, Pipeline
    from haystack.core.errors import PipelineRuntimeError
    from haystack.utils import Secret

    from plugsearch.integrations.haystack import PlugsearchRetriever, PlugsearchRetrieverError

    component = PlugsearchRetriever(url=searcher_url, api_key=Secret.from_token(KEY), mode="s3")
    pipeline = Pipeline()
    pipeline.add_component("retriever", component)
    try:
        docs = pipeline.run({"retriever": {"query": QUESTION}})["retriever"]["documents"]
        assert docs and all(isinstance(d, Document) for d in docs)
        first = docs[0]
        assert first.id and first.content and first.meta["title"] and isinstance(first.score, float)
        check_search(first.meta, "s3")
        naive = component.run(QUESTION, mode="naive", retrieve_k=3)["documents"]
        assert len(naive) == 3
        check_search(naive[0].meta, "naive")
        dense = PlugsearchRetriever(url=searcher_url, api_key=Secret.from_token(KEY), mode="naive", method="dense")
        with pytest.raises(PlugsearchRetrieverError) as caught:
            dense.run(QUESTION)
        dense.close()
        check_error(caught.value, 400, "dense", param="method")
        wrong = Pipeline()
        refused = PlugsearchRetriever(url=searcher_url, api_key=Secret.from_token("nope"))
        wrong.add_component("retriever", refused)
        with pytest.raises(PipelineRuntimeError) as failed:
            wrong.run({"retriever": {"query": QUESTION}})
        refused.close()
        cause: BaseException | None = failed.value
        while cause is not None and not isinstance(cause, PlugsearchRetrieverError):
            cause = cause.__cause__
        assert cause is not None
        check_error(cause, 401, "missing or invalid API key")
    finally:
        component.close()


def test_haystack_component_serializes_without_its_key(searcher_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from haystack import Pipeline

    from plugsearch.integrations.haystack import PlugsearchRetriever

    monkeypatch.setenv("PLUGSEARCH_API_KEY", KEY)
    pipeline = Pipeline()
    pipeline.add_component("retriever", PlugsearchRetriever(url=searcher_url, mode="naive", retrieve_k=2))
    text = pipeline.dumps()
    assert KEY not in text and "PLUGSEARCH_API_KEY" in text
    loaded = Pipeline.loads(text, allowed_modules=["plugsearch.integrations.haystack"])  # Haystack asks
    docs = loaded.run({"retriever": {"query": QUESTION}})["retriever"]["documents"]
    assert len(docs) == 2  # the key came back from the environment
    loaded.get_component("retriever").close()


async def test_haystack_component_async(searcher_url: str) -> None:
    from haystack.utils import Secret

    from plugsearch.integrations.haystack import PlugsearchRetriever

    component = PlugsearchRetriever(url=searcher_url, api_key=Secret.from_token(KEY), mode="naive", retrieve_k=3)
    try:
        docs = (await component.run_async(QUESTION))["documents"]
        assert len(docs) == 3
        check_search(docs[0].meta, "naive")
    finally:
        await component.aclose()


# ------------------------------------------------------------------------------------------------------ DSPy
def test_dspy_retriever(searcher_url: str) -> None:
    import dspy

    from plugsearch.integrations.dspy import PlugsearchRetrieverError, PlugsearchRM

    search = PlugsearchRM(searcher_url, api_key=KEY, mode="s3")
    try:
        assert isinstance(search, dspy.Retrieve)
        found = search(QUESTION)
        assert isinstance(found, dspy.Prediction)
        assert found.passages and len(found.passages) == len(found.documents) == len(found.ids)
        first = found.documents[0]
        assert found.passages[0] == f"{first['title']} | {first['text']}" and found.ids[0] == first["id"]
        assert found.scores[0] == first["score"]
        check_search({k: found[k] for k in SEARCH_KEYS}, "s3")
        assert len(search(QUESTION, k=1).passages) == 1
        with pytest.raises(PlugsearchRetrieverError) as caught:
            search(QUESTION, method="dense")
        assert isinstance(caught.value, dspy.DSPyError)
        check_error(caught.value, 400, "dense", param="method")
    finally:
        search.close()


async def test_dspy_retriever_async(searcher_url: str) -> None:
    from plugsearch.integrations.dspy import PlugsearchRetrieverError, PlugsearchRM

    search = PlugsearchRM(searcher_url, api_key=KEY, mode="naive", retrieve_k=5)
    try:
        found = await search.acall(QUESTION)
        assert len(found.passages) == 5 and found.mode == "naive"
        wrong = PlugsearchRM(searcher_url, api_key="wrong-key")
        with pytest.raises(PlugsearchRetrieverError) as caught:
            await wrong.acall(QUESTION)
        await wrong.aclose()
        check_error(caught.value, 401, "missing or invalid API key")
    finally:
        await search.aclose()
