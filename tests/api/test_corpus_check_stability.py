"""A corpus check's verdict holds still while documents change: 1,000 small writes (documents put, replaced and
deleted) against the real retriever app (bm25s over ~300 real passages, its change log, in-process over ASGI), the
searcher's gate asked before every write's next search, as `POST /search` asks it. The retriever's index identity
moves with every write; the verdict does not: it is checked again only once 5% of the passages changed and the
re-check interval has passed (the gate's clock advances one second per write: 1,000 s of writes, one re-check
allowed per 600 s), and the re-check replaces it only if its interval clearly excludes the standing verdict's side.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from plugsearch.common.cache import MemoryCache, ResultCache
from plugsearch.common.clients import RetrieverClient
from plugsearch.common.http import ClientSettings
from plugsearch.common.schemas.searcher import SearchRequest
from plugsearch.retriever.api import create_app as retriever_app
from plugsearch.searcher.api import sampler
from plugsearch.searcher.compact import CompactPolicy
from plugsearch.searcher.corpus_check import CorpusGate
from plugsearch.searcher.index_identity import IndexIdentity
from plugsearch.searcher.retrieval import ServiceRetriever
from plugsearch.searcher.serving import SearchService
from plugsearch.searcher.settings import SearcherSettings
from plugsearch.searcher.trained import COMPACT_DIR
from tests.asgi import app_client
from tests.support.retriever import tiny_bm25s, tiny_settings
from tests.unit.test_live_changes import wait_ready

TOKEN = "internal-token-123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WRITES = 1000
SCRATCH = 25
"""The writes rotate over this many documents (added, then replaced; every 5th write deletes one)."""


@pytest.fixture(scope="module")
def tiny(data_dir: Path, var_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return tiny_bm25s(data_dir, var_dir, tmp_path_factory.mktemp("stable"))


def new_texts(data_dir: Path, n: int) -> list[tuple[str, str]]:
    """(title, text) of `n` real passages the tiny corpus does not hold (nq_gold rows 200+)."""
    out: list[tuple[str, str]] = []
    with (data_dir / "corpus" / "nq_gold.jsonl").open() as fh:
        for i, line in enumerate(fh):
            if i >= 200:
                row = json.loads(line)
                out.append((row["title"], row["text"]))
            if len(out) >= n:
                break
    return out


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
async def served(tiny: tuple[Path, Path], tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, RetrieverClient]]:
    app = retriever_app(tiny_settings(*tiny, dense=False, changes_dir=tmp_path / "changes", internal_token=TOKEN))
    async with app_client(app) as http:
        await wait_ready(http, TOKEN)
        client = RetrieverClient(ClientSettings(url="http://retriever", token=SecretStr(TOKEN), max_retries=0,
                                                breaker_failures=100), transport=httpx.ASGITransport(app=app))
        try:
            yield http, client
        finally:
            await client.aclose()


async def test_a_thousand_small_writes_leave_the_verdict_unchanged_and_run_one_recheck(
        served: tuple[httpx.AsyncClient, RetrieverClient], data_dir: Path) -> None:
    http, client = served
    policy = CompactPolicy.load(COMPACT_DIR)
    retriever = ServiceRetriever(client)
    clock = Clock()
    settings = SearcherSettings()
    gate = CorpusGate(policy, retriever, sampler(client), questions=60, manifest=policy.manifest, clock=clock,
                      recheck_share=settings.corpus_check_recheck_share,
                      min_interval_s=settings.corpus_check_min_interval_s)
    svc = SearchService(settings, policy=policy, retriever=retriever, cache=ResultCache(MemoryCache(), name="search"),
                        index_identity=IndexIdentity(client, ttl_s=0), corpus_gate=gate)
    svc.start_corpus_check()
    await svc.corpus_checked()
    first = gate.last
    assert first is not None and first.rule == "first" and first.kind == "pseudo" and first.questions >= 30
    texts = new_texts(data_dir, 60)
    identities, decisions, fallbacks = set(), [], set()
    unchanged = 0  # deletes of a scratch document not served at that moment: nothing logged, the identity stays
    for i in range(WRITES):
        clock.now += 1.0
        doc = f"scratch-{i % SCRATCH}"
        if i % 5 == 4:
            response = await http.post("/documents/delete", json={"ids": [f"scratch-{(i + 3) % SCRATCH}"]},
                                       headers=AUTH)
        else:
            title, text = texts[i % len(texts)]
            response = await http.put("/documents", json={"documents": [{"id": doc, "title": title, "text": text}]},
                                      headers=AUTH)
        assert response.status_code == 200, response.text
        unchanged += response.json()["documents"] == 0
        identities.add(response.json()["index_id"])
        prepared = await svc.prepare(SearchRequest(question="who wrote the novel the lord of the rings"))
        fallbacks.add(prepared.fallback)
        await gate.settled()  # a re-check that started runs to its end before the next write
        assert gate.last is not None
        decisions.append(gate.last.decision)
    version = (await http.get("/version")).json()["details"]
    assert version["changes"]["seq"] == WRITES - unchanged and version["changes"]["passages"] > WRITES * 4 // 5
    assert len(identities) == WRITES - unchanged  # the identity moved with every change: the old gate checked each
    assert set(decisions) == {first.decision}, decisions  # the verdict held
    assert len(fallbacks) == 1  # and every s3 search was served the same way throughout
    # 5% of ~300 passages changed within the first writes; the interval allowed one re-check in 1,000 s
    assert gate.checks == 2 and gate.rechecks == 1
    last = gate.last
    assert last is not None and last is not first and last.rule in ("kept", "confirmed")
    assert last.changed_passages > first.changed_passages
    described = gate.describe()
    assert described["checks"] == 2 and described["since_verdict"]["passages_changed"] > 0
    assert described["last"]["kind"] == "pseudo" and described["last"]["interval"] == last.interval
