"""The packaged compact policy on a pinned sample of evaluation questions from the real corpus: the 3 documents
and the follow-up queries it returns, with the retrievals it saw replayed (their ids and scores stored in
tests/data/compact_sample.json, the passages read from ../shared/data). The sample was recorded by
`python bench/compact_documents.py --fixture tests/data/compact_sample.json` (the first 3 questions of each set).
Its documents, queries and final rankings (the 10 best-scored documents of the last step's pool) were first those
of the policy before its features were computed over the pool at once (the vectorised features reproduced all
388 evaluation questions' documents); recorded again when the follow-up candidates became names and titles only
(issue 40), again when a title follow-up became the title and the question's remaining content words instead of
the question copied, and lone nationality and common words stopped being names (issue 46), and whenever the
packaged policy is retrained. A change to the features, the pool, the candidates or
the environment that changes what the policy returns or how it ranks fails here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.compact_documents import final_ranking
from plugsearch.common.schemas.base import Document
from plugsearch.common.schemas.searcher import SearchParams
from plugsearch.retriever.store.corpus import corpus_lines, parse_line
from plugsearch.searcher.compact import CompactPolicy
from plugsearch.searcher.loop import run_search
from plugsearch.searcher.trained import COMPACT_DIR

SAMPLE = Path(__file__).resolve().parent.parent / "data" / "compact_sample.json"


class ReplayRetriever:
    """Answers each (method, query) with the stored ranking, the passages read from the corpus."""

    def __init__(self, retrievals: dict[str, dict[str, list[Any]]], passages: dict[str, tuple[str, str]]) -> None:
        self.retrievals = retrievals
        self.passages = passages
        self.requests: list[tuple[list[str], str]] = []

    async def retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        name = method or "bm25"
        self.requests.append((list(queries), name))
        return [[Document(id=doc_id, title=self.passages[doc_id][0], text=self.passages[doc_id][1], score=score)
                 for doc_id, score in self.retrievals[name][q][:k]] for q in queries]


@pytest.fixture(scope="module")
def sample(data_dir: Path) -> tuple[dict[str, Any], dict[str, tuple[str, str]]]:
    pinned = json.loads(SAMPLE.read_text())
    wanted = {doc_id for q in pinned["questions"] for ranked in q["retrievals"].values() for docs in ranked.values()
              for doc_id, _ in docs}
    corpus = data_dir / "corpus" / pinned["corpus"]
    passages = {}
    for lineno, line in corpus_lines(corpus):
        doc_id, title, text = parse_line(line, lineno, corpus)
        if doc_id in wanted:
            passages[doc_id] = (title, text)
    assert wanted <= passages.keys(), "the sample's passages are not all in the shared corpus"
    return pinned, passages


async def test_the_packaged_policy_returns_the_pinned_documents(
        sample: tuple[dict[str, Any], dict[str, tuple[str, str]]]) -> None:
    pinned, passages = sample
    policy = CompactPolicy.load(COMPACT_DIR)
    assert pinned["policy"] == policy.model, "the packaged weights changed: record the sample again"
    params = SearchParams(mode="s3", **pinned["setting"])
    assert len(pinned["questions"]) == 12
    for row in pinned["questions"]:
        retriever = ReplayRetriever(row["retrievals"], passages)
        outcome = await run_search(row["question"], params, policy=policy, retriever=retriever)
        assert [d.id for d in outcome.documents] == row["documents"], (row["dataset"], row["id"])
        assert outcome.queries == row["queries"], (row["dataset"], row["id"])
        # the final pool's 10 best-scored documents in order: a finer check of the features than the 3 returned
        assert final_ranking(policy, row["question"], outcome.blocks) == row["ranking"], (row["dataset"], row["id"])
        assert len(outcome.documents) == 3 and outcome.stop_reason == "complete"
        # the pool's two retrievals, then both follow-up searches in one retrieval (the second one prefetched)
        assert [method for _, method in retriever.requests] == ["bm25", "dense", "bm25"]
