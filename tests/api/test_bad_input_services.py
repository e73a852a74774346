"""A hand-written bad-input table per endpoint of every service (the real apps in-process, lifespans
running): each input gets its documented 4xx in the error envelope, and a good request right after it
still succeeds, so no bad input breaks the service for the next caller.

The apps run on deterministic backends: a tiny real bm25s index over the first passages of the shared
corpus (built once per session under a temporary folder), the scripted fake LLM (s3 policy / echo /
yes) over the OpenAI wire format. The builders are shared with `test_fuzz_services.py`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from plugsearch.common.cache import MemoryCache, ResultCache
from plugsearch.common.clients import RetrieverClient
from plugsearch.common.http import ClientSettings
from plugsearch.common.llm import LLMSettings, OpenAIChatClient
from plugsearch.generator.tokens import EstimatedTokens
from plugsearch.searcher.retrieval import ServiceRetriever
from tests.asgi import app_client
from tests.support import fake_policy
from tests.support.chat_policy import chat as chat_policy
from tests.support.fake_llm import create_fake_llm_app, yes

TINY_PASSAGES = 300
SERVICES = ("searcher", "retriever", "generator", "judge")


# ---------------------------------------------------------------------------------------- builders
def build_tiny_index(data_dir: Path, folder: Path) -> tuple[Path, Path]:
    """The first passages of the shared corpus (a temporary copy, never in the repo) + their bm25s index."""
    from plugsearch.retriever.indexing.build import build
    from plugsearch.retriever.settings import RetrieverSettings

    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "tiny.jsonl"
    if not corpus.exists():
        with (data_dir / "corpus" / "combined.jsonl").open("rb") as src:
            lines = [src.readline() for _ in range(TINY_PASSAGES)]
        corpus.write_bytes(b"".join(lines))
    index_dir = folder / "index"
    build(RetrieverSettings(corpus=corpus, index_dir=index_dir), bm25=["bm25s"], dense=False, force=False,
          show_progress=False)
    return corpus, index_dir


def prepare_tiny_index(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from plugsearch.retriever.backends.bm25s_index import Bm25sRetriever

    corpus, index_dir = build_tiny_index(data_dir, tmp_path_factory.mktemp("tiny_retriever"))
    # Compile bm25s's numba scorer once, here on the main thread: every app built later in this
    # process reuses it, so the background index loads of the apps are quick.
    Bm25sRetriever(index_dir / "bm25s", threads=1).close()
    return corpus, index_dir


@pytest.fixture(scope="session")
def tiny_index(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return prepare_tiny_index(data_dir, tmp_path_factory)


async def _wait_ready(client: httpx.AsyncClient, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        response = await client.get("/health/ready")
        if response.status_code == 200:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not ready after {timeout_s} s: {response.text}")
        await asyncio.sleep(0.05)


@asynccontextmanager
async def retriever_client(index: tuple[Path, Path], **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    from plugsearch.retriever.api import create_app
    from plugsearch.retriever.settings import RetrieverSettings

    corpus, index_dir = index
    app = create_app(RetrieverSettings(corpus=corpus, index_dir=index_dir, bm25_threads=1, **settings))
    async with app_client(app) as client:
        await _wait_ready(client)
        yield client


@asynccontextmanager
async def searcher_client(index: tuple[Path, Path], **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The searcher over the real (tiny) retriever app and the scripted s3/QAgent policy."""
    from plugsearch.retriever.api import create_app as create_retriever
    from plugsearch.retriever.settings import RetrieverSettings
    from plugsearch.searcher.api import create_app
    from plugsearch.searcher.settings import SearcherSettings

    corpus, index_dir = index
    retriever_app = create_retriever(RetrieverSettings(corpus=corpus, index_dir=index_dir, bm25_threads=1))
    llm = create_fake_llm_app(fake_policy.respond)
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(retriever_app.router.lifespan_context(retriever_app))
        rclient = RetrieverClient(ClientSettings(url="http://retriever", max_retries=0),
                                  transport=httpx.ASGITransport(app=retriever_app))
        stack.push_async_callback(rclient.aclose)
        policy = OpenAIChatClient(LLMSettings(base_url="http://llm/v1", model="fake-policy", max_retries=0),
                                  transport=httpx.ASGITransport(app=llm))
        stack.push_async_callback(policy.aclose)
        app = create_app(SearcherSettings(**settings), policy=chat_policy(policy), retriever=ServiceRetriever(rclient),
                         cache=ResultCache(MemoryCache(), name="search"))
        client = await stack.enter_async_context(app_client(app))
        deadline = asyncio.get_running_loop().time() + 60
        while (await rclient.ready()) != "ok":  # the retriever loads its index in the background
            assert asyncio.get_running_loop().time() < deadline, "tiny retriever never became ready"
            await asyncio.sleep(0.05)
        yield client


@asynccontextmanager
async def generator_client(**settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    from plugsearch.generator.api import create_app
    from plugsearch.generator.settings import GeneratorSettings

    llm = create_fake_llm_app(lambda body: "Paris")
    app = create_app(GeneratorSettings(llm=LLMSettings(base_url="http://llm/v1", model="fake-gen", max_retries=0),
                                       tokenizer_from_gguf=False, **settings),
                     llm_transport=httpx.ASGITransport(app=llm), tokens=EstimatedTokens())
    async with app_client(app) as client:
        yield client


@asynccontextmanager
async def judge_client(**settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    from plugsearch.judge.api import create_app
    from plugsearch.judge.settings import JudgeSettings

    llm = create_fake_llm_app(yes)
    app = create_app(JudgeSettings(llm=LLMSettings(base_url="http://llm/v1", model="fake-judge", max_retries=0),
                                   **settings), llm_transport=httpx.ASGITransport(app=llm))
    async with app_client(app) as client:
        yield client


def service_client(name: str, index: tuple[Path, Path], **settings: Any) -> Any:
    """An async context manager yielding an httpx client of the named service's running app."""
    if name == "searcher":
        return searcher_client(index, **settings)
    if name == "retriever":
        return retriever_client(index, **settings)
    if name == "generator":
        return generator_client(**settings)
    return judge_client(**settings)


GOOD: dict[str, dict[str, Any]] = {
    "/search": {"question": "Who directed the film?", "max_turns": 1},
    "/search/batch": {"items": [{"question": "Who directed the film?", "mode": "naive", "max_turns": 1}]},
    "/retrieve": {"queries": ["film director"], "k": 3},
    "/searchr1/retrieve": {"queries": ["film director"], "topk": 2, "return_scores": True},
    "/generate": {"question": "Capital of France?", "documents": [{"title": "Paris", "text": "Paris is ..."}]},
    "/generate/batch": {"items": [{"question": "Capital of France?"}]},
    "/judge": {"prediction": "Paris", "golden_answers": ["Paris"]},
    "/judge/batch": {"items": [{"prediction": "Paris", "golden_answers": ["Paris"], "mode": "em"}]},
}
ENDPOINTS: dict[str, tuple[str, ...]] = {
    "searcher": ("/search", "/search/batch"),
    "retriever": ("/retrieve", "/searchr1/retrieve"),
    "generator": ("/generate", "/generate/batch"),
    "judge": ("/judge", "/judge/batch"),
}


# ------------------------------------------------------------------------------------ the table
Case = tuple[str, Callable[[dict[str, Any]], Any], int, str]
"""(name, body made from the endpoint's good body, expected status, expected error type)."""

HUGE = "x" * 1_000_000  # under the 2 MiB body limit, over every text limit
OVER_LIMIT = "y" * (3 * 1024 * 1024)  # over the default 2 MiB body limit


def _first_text_field(body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The dict and key of the endpoint's main text (question, prediction, first query)."""
    target = body["items"][0] if "items" in body else body
    for key in ("question", "prediction"):
        if key in target:
            return target, key
    return target, "queries"


def _with_text(value: Any) -> Callable[[dict[str, Any]], Any]:
    def make(good: dict[str, Any]) -> Any:
        body = json.loads(json.dumps(good))
        target, key = _first_text_field(body)
        target[key] = [value] if key == "queries" else value
        return body
    return make


def _with_number(value: Any) -> Callable[[dict[str, Any]], Any]:
    """Sets the endpoint's integer knob (k, topk, max_turns, max_tokens, ...) to `value`."""
    def make(good: dict[str, Any]) -> Any:
        body = json.loads(json.dumps(good))
        target = body["items"][0] if "items" in body else body
        for key in ("k", "topk", "max_turns"):
            if key in target:
                target[key] = value
                return body
        if "golden_answers" in target:
            target["golden_answers"] = value  # a number where a list belongs
        else:
            target["max_tokens"] = value
        return body
    return make


def _raw(data: bytes) -> Callable[[dict[str, Any]], Any]:
    return lambda good: data


CASES: list[Case] = [
    ("empty body", _raw(b""), 422, "validation_error"),
    ("empty object", lambda good: {}, 422, "validation_error"),
    ("null", _raw(b"null"), 422, "validation_error"),
    ("a list instead of an object", lambda good: [good], 422, "validation_error"),
    ("empty text", _with_text(""), 422, "validation_error"),
    ("blank text", _with_text(" \t\n "), 422, "validation_error"),
    ("huge text", _with_text(HUGE), 422, "validation_error"),
    ("text of a number", _with_text(12345), 422, "validation_error"),
    ("text of an object", _with_text({"$gt": ""}), 422, "validation_error"),
    ("NUL character", _with_text("who\x00am i"), 422, "validation_error"),
    ("lone surrogate", _with_text("a\ud800b"), 422, "validation_error"),
    ("NaN", _with_number(float("nan")), 422, "validation_error"),
    ("Infinity", _with_number(float("inf")), 422, "validation_error"),
    ("negative number", _with_number(-1), 422, "validation_error"),
    ("enormous number", _with_number(10**30), 422, "validation_error"),
    ("number past Python's digit limit", lambda good: "RAW", 400, "invalid_json"),
    ("fractional number", _with_number(2.5), 422, "validation_error"),
    ("boolean number", _with_number([True]), 422, "validation_error"),
    ("unknown field", lambda good: {**good, "extra_option": 1}, 422, "validation_error"),
    ("invalid JSON", _raw(b'{"question": "who", '), 400, "invalid_json"),
    ("invalid UTF-8", _raw(b'{"question": "\xff\xfe"}'), 400, "invalid_json"),
    ("deep nesting", _raw(b'{"question": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"), 400, "invalid_json"),
    ("body over the size limit", _raw(OVER_LIMIT.encode()), 413, "payload_too_large"),
    ("wrong content type", lambda good: "TEXT", 415, "unsupported_media_type"),
    ("empty batch", lambda good: {"items": []} if "items" in good else {"queries": []}, 422, "validation_error"),
]

BLANK_IS_FINE = {("/searchr1/retrieve", "empty text"), ("/searchr1/retrieve", "blank text")}
"""Search-R1's server answers a blank query with an empty list (not a failed batch), and so does ours."""

UNICODE_OK = ["¿Quién dirigió 東京物語?", "emoji 🔍🙏 question", "rtl \u202e reversed \u202c text",
              "zero\u200bwidth", "combining e\u0301\u0301\u0301", "control \x1b[31m red \x07 bell"]
"""Odd but valid text: must not fail (200), whatever the service makes of it."""


async def _send(client: httpx.AsyncClient, path: str, body: Any) -> httpx.Response:
    if body == "TEXT":
        return await client.post(path, content=json.dumps(GOOD[path]), headers={"content-type": "text/plain"})
    if body == "RAW":
        content = b'{"k": 1' + b"0" * 5000 + b', "max_turns": 1' + b"0" * 5000 + b"}"
        return await client.post(path, content=content, headers={"content-type": "application/json"})
    if isinstance(body, bytes):
        return await client.post(path, content=body, headers={"content-type": "application/json"})
    return await client.post(path, content=json.dumps(body, allow_nan=True),
                             headers={"content-type": "application/json"})


@pytest.mark.parametrize("service", SERVICES)
async def test_bad_input_table(service: str, tiny_index: tuple[Path, Path]) -> None:
    failures: list[str] = []
    async with service_client(service, tiny_index) as client:
        for path in ENDPOINTS[service]:
            good = GOOD[path]
            for name, make, status, type_ in CASES:
                response = await _send(client, path, make(good))
                if (path, name) in BLANK_IS_FINE:
                    if response.status_code != 200 or response.json()["result"] != [[]]:
                        failures.append(f"{path} {name}: {response.status_code} {response.text[:120]} "
                                        "(want 200 with an empty list)")
                    continue
                try:
                    envelope = response.json()["error"]
                except (ValueError, KeyError, TypeError):
                    failures.append(f"{path} {name}: no error envelope ({response.status_code} {response.text[:80]})")
                    continue
                if response.status_code != status or envelope["type"] != type_:
                    failures.append(f"{path} {name}: {response.status_code} {envelope['type']} "
                                    f"(want {status} {type_}): {envelope['message'][:120]}")
                assert envelope["request_id"] == response.headers["x-request-id"]
                after = await client.post(path, json=good)
                if after.status_code != 200:
                    failures.append(f"{path} after {name}: good request got {after.status_code}")
            for text in UNICODE_OK:
                response = await _send(client, path, _with_text(text)(good))
                if response.status_code != 200:
                    failures.append(f"{path} unicode {text!r}: {response.status_code} {response.text[:120]}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("service", SERVICES)
async def test_wrong_methods_and_paths_are_4xx_envelopes(service: str, tiny_index: tuple[Path, Path]) -> None:
    async with service_client(service, tiny_index) as client:
        for path in ENDPOINTS[service]:
            response = await client.get(path)
            assert response.status_code == 405 and response.json()["error"]["type"] == "method_not_allowed"
            response = await client.put(path, json=GOOD[path])
            assert response.status_code == 405
        response = await client.post("/nope", json={})
        assert response.status_code == 404 and response.json()["error"]["type"] == "not_found"
        response = await client.post("/health/live", json={})
        assert response.status_code == 405


async def test_limits_in_the_schemas_refuse_oversized_batches(tiny_index: tuple[Path, Path]) -> None:
    """One past each documented batch maximum is a 422 before any work starts."""
    from plugsearch.common.schemas import generator, judge, retriever, searcher

    async with searcher_client(tiny_index) as client:
        items = [{"question": "q", "mode": "naive"}] * (searcher.MAX_BATCH + 1)
        assert (await client.post("/search/batch", json={"items": items})).status_code == 422
        assert (await client.post("/search", json={"question": "q", "max_turns": searcher.MAX_TURNS + 1})
                ).status_code == 422
        assert (await client.post("/search", json={"question": "q", "retrieve_k": 3, "select_k": 4})
                ).status_code == 422
        # A method the (bm25-only) retriever does not serve is the caller's mistake: 400, not a 502.
        unserved = await client.post("/search", json={"question": "q", "method": "hybrid"})
        assert unserved.status_code == 400 and unserved.json()["error"]["param"] == "method"
    async with retriever_client(tiny_index) as client:
        assert (await client.post("/retrieve", json={"queries": ["q"], "k": retriever.MAX_K + 1})
                ).status_code == 422
        assert (await client.post("/retrieve", json={"queries": ["q"] * (retriever.MAX_BATCH + 1)})
                ).status_code == 422
        assert (await client.post("/retrieve", json={"queries": ["q"], "method": "magic"})).status_code == 422
    async with generator_client() as client:
        items = [{"question": "q"}] * (generator.MAX_BATCH + 1)
        assert (await client.post("/generate/batch", json={"items": items})).status_code == 422
        docs = [{"text": "t"}] * (generator.MAX_DOCS + 1)
        assert (await client.post("/generate", json={"question": "q", "documents": docs})).status_code == 422
    async with judge_client() as client:
        answers = ["a"] * (judge.MAX_ANSWERS + 1)
        assert (await client.post("/judge", json={"prediction": "a", "golden_answers": answers})).status_code == 422
