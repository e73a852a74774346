"""The naive-start learner (`plugsearch.trainer.compact.rerank`): its start is naive BM25 top-k exactly (one search,
BM25's three first documents), it stays there when the training questions carry no signal, and it moves where they
do; its linear scorer travels in the compact policy's MLP without changing a score."""

from __future__ import annotations

import asyncio
import math
import random

import numpy as np
import pytest

from plugsearch.common.qa import QAItem
from plugsearch.common.schemas.base import Document
from plugsearch.common.schemas.searcher import SearchParams
from plugsearch.searcher.compact import (
    DENSE_FEATURES,
    DENSE_SCORER,
    DOC_FEATURES,
    LEXICAL_SCORER,
    CompactPolicy,
)
from plugsearch.searcher.loop import run_search
from plugsearch.trainer.compact import rerank
from plugsearch.trainer.compact.config import CompactConfig
from plugsearch.trainer.compact.data import labeled

POOL = 30


class SyntheticRetriever:
    """Question i: BM25 returns 30 passages (scores descending), the dense method 30 (half of BM25's, half its
    own). The passage holding the answer ("answer 1987") sits at BM25 rank `answer_rank(i)`; it alone has a
    number, so a learner can find it by that feature where BM25's rank does not say."""

    def __init__(self, answer_rank: dict[int, int]) -> None:
        self.answer_rank = answer_rank
        self.calls: list[tuple[str, str | None]] = []

    @staticmethod
    def index(question: str) -> int:
        return int(question.split()[1])

    def bm25(self, i: int) -> list[Document]:
        docs = []
        for r in range(POOL):
            answer = r == self.answer_rank[i]
            text = f"passage {r} of topic {i} " + ("answer 1987 here" if answer else "nothing to see here")
            docs.append(Document(id=f"q{i}-b{r}", title=f"Topic {i} part {r}", text=text, score=float(60 - r)))
        return docs

    async def retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        out = []
        for q in queries:
            self.calls.append((q, method))
            i = self.index(q)
            if method == "dense":
                lexical = self.bm25(i)[::2]
                own = [Document(id=f"q{i}-d{r}", title=f"Dense {i} {r}", text=f"other passage {r}", score=0.0)
                       for r in range(POOL - len(lexical))]
                docs = [d.model_copy(update={"score": 0.9 - 0.01 * j}) for j, d in enumerate(lexical + own)]
            else:
                docs = self.bm25(i)
            out.append(docs[:k])
        return out


def questions(n: int, offset: int = 0) -> list[QAItem]:
    return [QAItem(id=f"q{i}", question=f"question {i} asks what", golden_answers=["1987"])
            for i in range(offset, offset + n)]


def served(policy: CompactPolicy, items: list[QAItem], retriever: SyntheticRetriever) -> list[list[str]]:
    params = SearchParams(mode="s3", retrieve_k=POOL, select_k=3, max_turns=2, method="bm25",
                          pool_methods=["bm25", "dense"])

    async def go() -> list[list[str]]:
        return [[d.id for d in (await run_search(q.question, params, policy=policy, retriever=retriever)).documents]
                for q in items]

    return asyncio.run(go())


def test_the_naive_start_serves_naive_bm25_top_3_in_one_search() -> None:
    retriever = SyntheticRetriever({i: random.Random(i).randrange(POOL) for i in range(8)})
    policy = rerank.policy_of({s: rerank.naive_scorer(s) for s in (LEXICAL_SCORER, DENSE_SCORER)})
    policy.manifest = {"dense": {"encoder": "e"}}
    got = served(policy, questions(8), retriever)
    assert got == [[f"q{i}-b{r}" for r in range(3)] for i in range(8)]
    assert {m for _, m in retriever.calls} == {"bm25", "dense"} and len(retriever.calls) == 16  # no follow-up


def test_the_mlp_carries_the_linear_score_exactly() -> None:
    rng = np.random.default_rng(0)
    for scorer in (LEXICAL_SCORER, DENSE_SCORER):
        n = rerank.n_features(scorer)
        linear = rerank.LinearScorer(rng.normal(size=n), rng.random(n) + 0.5, rng.random(2), rng.normal(size=n))
        policy = rerank.policy_of({scorer: linear})
        x = rng.normal(size=(40, n)).astype(np.float32)
        assert np.allclose(policy.doc_logits(x, scorer), linear.scores(x), atol=1e-4)
    assert rerank.n_features(DENSE_SCORER) == len(DOC_FEATURES) + len(DENSE_FEATURES)


def pools_of(n: int, informative: bool, seed: int) -> list[rerank.FirstPool]:
    """Synthetic first pools in BM25 order: the good passage is where `has_number` is 1 and at a random rank
    (informative), or at the top BM25 ranks whatever the features say (BM25 already right)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.normal(size=(POOL, len(DOC_FEATURES))).astype(np.float32)
        ranks = np.arange(POOL)
        x[:, DOC_FEATURES.index("inv_rank")] = 1 / (ranks + 1)
        x[:, DOC_FEATURES.index("log_rank")] = np.log1p(ranks) / math.log(51)
        good = int(rng.integers(POOL)) if informative else int(rng.integers(2))
        x[:, DOC_FEATURES.index("has_number")] = 0
        x[good, DOC_FEATURES.index("has_number")] = float(informative or rng.random() < 0.5)
        y = np.zeros(POOL, np.float32)
        y[good] = 1
        out.append(rerank.FirstPool({LEXICAL_SCORER: (x, y, y > 0, np.zeros(POOL, bool))}))
    return out


def recall(scorer: rerank.LinearScorer, pools: list[rerank.FirstPool]) -> float:
    return float(np.mean([p.hit(scorer.scores(p.pools[LEXICAL_SCORER][0]), 3) for p in pools]))


@pytest.mark.parametrize("informative", [False, True])
def test_it_stays_naive_without_signal_and_moves_with_it(informative: bool) -> None:
    train = labeled(questions(60))
    pools = pools_of(60, informative, seed=1)
    choice = rerank.choose_penalty(train, pools, CompactConfig())
    assert choice.how == "5-fold over 60 training questions" and set(choice.recall or {}) == {
        rerank.penalty_text(p) for p in rerank.PENALTIES}
    norms = rerank.norms_of_pools(pools, LEXICAL_SCORER)
    assert norms is not None
    fitted = rerank.fit_linear(pools, LEXICAL_SCORER, choice.penalty, norms)
    test = pools_of(200, informative, seed=2)
    naive = recall(rerank.naive_scorer(LEXICAL_SCORER), test)
    if informative:  # BM25's order finds the good passage 3 times in 30; the number finds it
        assert choice.penalty < math.inf and naive < 0.3 and recall(fitted, test) > 0.9
    else:  # BM25's order is already right: whatever was chosen serves naive's hits
        assert naive == 1.0 and recall(fitted, test) == naive


def test_fewer_than_two_questions_keep_naive() -> None:
    choice = rerank.choose_penalty(labeled(questions(1)), pools_of(1, True, 0), CompactConfig())
    assert math.isinf(choice.penalty) and "fewer than 2" in choice.how


def test_learn_naive_on_a_corpus_where_the_answer_has_a_number_below_bm25s_top_3() -> None:
    ranks = {i: 3 + random.Random(i).randrange(20) for i in range(80)}
    retriever = SyntheticRetriever(ranks)
    retriever.methods, retriever.encoder = ["bm25", "dense"], "e"  # type: ignore[attr-defined]
    train, held = questions(60), questions(20, offset=60)
    policy, info = rerank.learn_naive(labeled(train), retriever, CompactConfig())
    learner = info["learner"]
    assert learner["start"] == "naive" and learner["rl"] is False and learner["pull"] != "keep"
    assert info["pool_recall"] == 1.0 and {"has_number", "has_year"} & set(info["largest_weights"])
    got = served(policy, held, retriever)
    assert all(f"q{q.id[1:]}-b{ranks[int(q.id[1:])]}" in ids for q, ids in zip(held, got, strict=True))
    # the same questions with the answer in BM25's first place: nothing to correct, naive's hits
    top = SyntheticRetriever(dict.fromkeys(range(80), 0))
    top.methods, top.encoder = ["bm25", "dense"], "e"  # type: ignore[attr-defined]
    policy, info = rerank.learn_naive(labeled(train), top, CompactConfig())
    assert all(ids[0] == f"q{q.id[1:]}-b0" for q, ids in zip(held, served(policy, held, top), strict=True))


def test_the_default_penalty_weakens_as_questions_grow_and_without_a_signal_the_policy_is_naive() -> None:
    assert rerank.default_penalty(25) == 0.2 and rerank.default_penalty(500) == 0.01
    # no training question whose pool holds an answer: nothing to fit, naive BM25's order exactly
    retriever = SyntheticRetriever({i: 99 for i in range(40)})  # the answer is in no pool
    retriever.methods, retriever.encoder = ["bm25", "dense"], "e"  # type: ignore[attr-defined]
    policy, info = rerank.learn_naive(labeled(questions(30)), retriever, CompactConfig())
    assert info["correction"] == {"lexical": 0.0, "dense": 0.0} and info["pool_recall"] == 0.0
    assert served(policy, questions(10, offset=30), retriever) == [[f"q{i}-b{r}" for r in range(3)]
                                                                  for i in range(30, 40)]
