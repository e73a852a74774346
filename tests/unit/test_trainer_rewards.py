"""Rewards, baselines and the s3 filter against a scripted fake stack (no servers)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from plugsearch.common.qa import QAItem, s3_filter, train_split
from plugsearch.common.schemas.base import Document
from plugsearch.common.schemas.retriever import Method
from plugsearch.trainer.common.baseline import BaselineConfig, BaselineStore, baselines_for, ensure_baselines
from plugsearch.trainer.common.rewards import RewardComputer, Trajectory, format_score
from plugsearch.trainer.common.upstreams import Answered


class FakeStack:
    """Retrieval returns one document per query whose text is the query; the 'generator' answers with
    the first document's text and the 'judge' scores span containment of the gold answer. With `together`,
    answering waits until that many answer calls are in flight at once (a gate: concurrent callers pass it,
    sequential ones would wait forever)."""

    def __init__(self, corpus: dict[str, str], together: int = 1) -> None:
        self.corpus = corpus
        self.together = together
        self.all_in = asyncio.Event()
        self.retrieve_calls: list[list[str]] = []
        self.answer_calls: list[int] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def retrieve(self, queries: Sequence[str], k: int, method: Method | None) -> list[list[Document]]:
        self.retrieve_calls.append(list(queries))
        return [[Document(id=f"d-{q}", title="t", text=self.corpus.get(q, "nothing"))] for q in queries]

    async def answer_and_judge(self, items: Sequence[tuple[str, Sequence[Document], Sequence[str]]]
                               ) -> list[Answered]:
        self.answer_calls.append(len(items))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if self.in_flight >= self.together:
            self.all_in.set()
        await asyncio.sleep(0)  # one turn of the loop, as any real call takes
        await self.all_in.wait()
        self.in_flight -= 1
        out = []
        for _, docs, gold in items:
            answer = docs[0].text if docs else ""
            ok = float(any(g.lower() in answer.lower() for g in gold))
            out.append(Answered(answer, ok, ok, ok, "span"))
        return out


def _item(qid: str, question: str, gold: list[str]) -> QAItem:
    return QAItem(id=qid, question=question, golden_answers=gold, dataset="nq")


async def test_gbr_is_searched_genacc_minus_naive_baseline(tmp_path: Path) -> None:
    # naive RAG of q1 already finds the answer; q2's does not
    stack = FakeStack({"q1": "Paris is the capital", "q2": "unrelated"})
    store = BaselineStore(tmp_path, BaselineConfig(k=3))
    items = [_item("1", "q1", ["Paris"]), _item("2", "q2", ["Berlin"])]
    good = [Document(id="x", text="Berlin it is")]
    bad = [Document(id="y", text="no idea")]
    computer = RewardComputer(stack, kind="gbr", baselines=store)
    scores = await computer.score([Trajectory(items[0], bad), Trajectory(items[1], good),
                                   Trajectory(items[1], bad), Trajectory(items[0], good)])
    assert [s.reward for s in scores] == [-1.0, 1.0, 0.0, -1.0]
    assert [s.baseline_genacc for s in scores] == [1.0, 0.0, 0.0, 1.0]
    # missing baselines were computed once per question (not once per rollout) and stored
    assert sorted(q for call in stack.retrieve_calls for q in call) == ["q1", "q2"]
    assert set(store.genacc_by_id()) == {"1", "2"}


async def test_other_reward_kinds_and_format_term(tmp_path: Path) -> None:
    stack = FakeStack({})
    item = _item("1", "q", ["Berlin"])
    traj = Trajectory(item, [Document(id="a", text="Berlin")], valid_actions=3, invalid_actions=1,
                      retrieved=[Document(id="a", text="Berlin"), Document(id="b", text="x")])
    (em,) = await RewardComputer(stack, kind="em", format_lambda=0.5).score([traj])
    assert em.reward == 1.0 and em.format_score == 0.75 and em.total == pytest.approx(1.375)
    miss = Trajectory(item, [Document(id="c", text="Munich")], retrieved=[Document(id="d", text="berlin wall")])
    (qa,) = await RewardComputer(stack, kind="qagent").score([miss])
    assert qa.reward == 0.5 and qa.hit == 1.0  # EM 0 + 0.5 x gold seen in the trajectory
    (both,) = await RewardComputer(stack, kind="gbr_genacc", baselines=BaselineStore(tmp_path, BaselineConfig())
                                   ).score([traj])
    assert both.reward == 2.0  # GBR 1 (baseline 0: "q" retrieves nothing useful) + GenAcc 1
    assert format_score(0, 0) == 0.0
    with pytest.raises(ValueError):
        RewardComputer(stack, kind="gbr")


async def test_batch_rewards_run_concurrently(tmp_path: Path) -> None:
    stack = FakeStack({}, together=2)
    store = BaselineStore(tmp_path, BaselineConfig())
    items = [_item(str(i), f"q{i}", ["a"]) for i in range(4)]
    async with asyncio.timeout(10):  # one after the other, the first answer call would never pass the gate
        await RewardComputer(stack, kind="gbr", baselines=store).score([Trajectory(it, []) for it in items])
    assert stack.max_in_flight == 2  # the batch's answers and the missing baselines were in flight together


async def test_baseline_store_survives_a_torn_line_and_mirrors_redis(tmp_path: Path, redis_url: str) -> None:
    stack = FakeStack({"q1": "a", "q2": "b"})
    config = BaselineConfig(k=2, tag="t")
    store = BaselineStore(tmp_path, config, redis_url=redis_url)
    counts = await ensure_baselines(stack, store, [_item("1", "q1", ["a"]), _item("2", "q2", ["z"])], batch=1)
    assert counts == {"done_before": 0, "computed": 2, "total": 2}
    await store.aclose()
    with store.path.open("ab") as fh:  # a kill in the middle of a write
        fh.write(b'{"id": "3", "question": "q3", "golden')
    reopened = BaselineStore(tmp_path, config, redis_url=redis_url)
    assert reopened.genacc_by_id() == {"1": 1.0, "2": 0.0}
    assert all(json.loads(line) for line in reopened.path.read_text().splitlines())
    # a fresh file (another machine) still finds the baselines in Redis
    other = BaselineStore(tmp_path / "elsewhere", config, redis_url=redis_url)
    found = await baselines_for(stack, other, [_item("1", "q1", ["a"])])
    assert found["1"].genacc == 1.0 and len(stack.retrieve_calls) == 2  # no recomputation
    await reopened.aclose()
    await other.aclose()


def test_s3_filter_drops_answered_and_yes_no_questions() -> None:
    items = [_item("1", "q", ["Paris"]), _item("2", "q", ["yes"]), _item("3", "q", ["Berlin"]),
             _item("4", "q", ["True"])]
    kept = s3_filter(items, {"1": 0.0, "2": 0.0, "3": 1.0, "4": 0.0})
    assert [k.id for k in kept] == ["1"]
    with pytest.raises(KeyError):
        s3_filter(items, {"1": 0.0})


def test_train_split_holds_out_eval_questions_and_interleaves(data_dir: Path) -> None:
    items = train_split(data_dir, ("nq", "hotpotqa"), per_dataset=3)
    assert [it.dataset for it in items] == ["nq", "hotpotqa"] * 3
    assert items[0].id == "nq-lim-0200"  # rows 0-99 evaluate, 100-199 are reserved


def test_resume_picks_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    from plugsearch.trainer.llm.grpo import last_checkpoint

    assert last_checkpoint(tmp_path / "missing") is None
    for step, complete in ((2, True), (4, True), (6, False)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        if complete:
            (folder / "trainer_state.json").write_text("{}")
    assert last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-4")  # 6 was cut mid-save


class RankedStack(FakeStack):
    """Naive ranking of a question: documents `<q>-1..k`; only the listed ranks hold the answer."""

    def __init__(self, answer_ranks: dict[str, set[int]]) -> None:
        super().__init__({})
        self.answer_ranks = answer_ranks
        self.depths: list[int] = []

    async def retrieve(self, queries: Sequence[str], k: int, method: Method | None) -> list[list[Document]]:
        self.depths.append(k)
        return [[Document(id=f"{q}-{r}", text="the answer is Oslo" if r in self.answer_ranks.get(q, set()) else "no")
                 for r in range(1, k + 1)] for q in queries]

    async def answer_and_judge(self, items: Sequence[tuple[str, Sequence[Document], Sequence[str]]]
                               ) -> list[Answered]:
        raise AssertionError("the recall reward calls no LLM")


async def test_recall_reward_is_hit_minus_naive_top_n_at_the_same_budget() -> None:
    stack = RankedStack({"q": {4}})  # naive finds the answer only at rank 4
    computer = RewardComputer(stack, kind="recall")
    item = _item("1", "q", ["Oslo"])
    answer = Document(id="q-4", text="the answer is Oslo")
    miss = Document(id="q-1", text="no")
    results = await computer.score([
        Trajectory(item=item, documents=[answer]),                  # 1 doc, found; naive top-1 misses: +1
        Trajectory(item=item, documents=[miss, miss, miss]),        # 3 docs, missed; naive top-3 misses: 0
        Trajectory(item=item, documents=[miss] * 4),                # 4 docs, missed; naive top-4 finds it: -1
        Trajectory(item=item, documents=[], valid_actions=1),       # nothing returned: 0, never negative
    ])
    assert [r.reward for r in results] == [1.0, 0.0, -1.0, 0.0]
    assert [r.baseline_genacc for r in results] == [0.0, 0.0, 1.0, 0.0]
    assert stack.depths == [16]  # one retrieval per question, deep enough for every budget
    deep = await computer.score([Trajectory(item=item, documents=[miss] * 20)])
    assert deep[0].reward == -1.0 and stack.depths == [16, 20]


async def test_a_trajectory_over_another_corpus_is_compared_with_that_corpus_s_naive_documents() -> None:
    """A shipped Wikipedia question mixed into a user's run (`--shipped`) carries its corpus's retriever: its
    naive documents come from there, not from the run's corpus, and the same question text over the two corpora
    is two baselines."""
    users, wiki = RankedStack({}), RankedStack({"q": {1}})
    computer = RewardComputer(None, kind="recall", retriever=users)
    item = _item("1", "q", ["Oslo"])
    found = Document(id="x", text="the answer is Oslo")
    results = await computer.score([Trajectory(item=item, documents=[found]),
                                    Trajectory(item=item, documents=[found], retriever=wiki)])
    assert [r.baseline_genacc for r in results] == [0.0, 1.0] and [r.reward for r in results] == [1.0, 0.0]
    assert users.depths == [16] and wiki.depths == [16]
    with pytest.raises(ValueError, match="recall reward only"):
        await RewardComputer(RankedStack({}), kind="genacc").score([Trajectory(item=item, documents=[found],
                                                                                retriever=wiki)])


async def test_recall_reward_adds_the_format_term() -> None:
    computer = RewardComputer(RankedStack({}), kind="recall", format_lambda=0.5)
    result = (await computer.score([Trajectory(item=_item("1", "q", ["Oslo"]), documents=[],
                                               valid_actions=1, invalid_actions=1)]))[0]
    assert result.reward == 0.0 and result.total == 0.25


async def test_gbr_at_the_same_budget_keeps_one_baseline_per_n_and_counts_service_time(tmp_path: Path) -> None:
    stack = RankedStack({"q": {2}})  # naive finds the answer at rank 2 only

    class Answering(RankedStack):
        async def answer_and_judge(self, items: Sequence[tuple[str, Sequence[Document], Sequence[str]]]
                                   ) -> list[Answered]:
            out = []
            for _, docs, gold in items:
                ok = float(any("Oslo" in d.text for d in docs) and bool(gold))
                out.append(Answered("Oslo" if ok else "no idea", ok, ok, ok, "span"))
            return out

    services = Answering({"q": {2}})
    store = BaselineStore(tmp_path, BaselineConfig(k=3))
    computer = RewardComputer(services, kind="gbr", baseline="same_n", baselines=store, retriever=stack)
    item = _item("1", "q", ["Oslo"])
    hit = Document(id="x", text="the answer is Oslo")
    miss = Document(id="y", text="no")
    scores = await computer.score([Trajectory(item, [hit]), Trajectory(item, [miss, miss]), Trajectory(item, [])])
    # GenAcc of the searched documents minus naive RAG's at the same n (top-1 misses, top-2 has it; nothing
    # returned is compared with top-1: the baseline is never a no-retrieval answer)
    assert [s.reward for s in scores] == [1.0, -1.0, 0.0] and [s.baseline_genacc for s in scores] == [0.0, 1.0, 0.0]
    assert {store.with_k(n).config.k for n in (1, 2)} == {1, 2} and set(store.with_k(2).genacc_by_id()) == {"1"}
    assert stack.depths == [1, 2]  # the naive documents came from the given retriever, not the services
    assert computer.service_seconds > 0
    with pytest.raises(ValueError, match="answers through the generator and judge"):
        RewardComputer(None, kind="gbr", baselines=store, retriever=stack)
    await computer.aclose()


def test_the_compact_trainer_rewards_through_the_one_computer(tmp_path: Path) -> None:
    """One RL step of the compact policy with `gbr` through (fake) services: the episodes are the searcher's,
    the reward the computer's, the step's log says how long the services took."""
    from plugsearch.trainer.compact.config import CompactConfig
    from plugsearch.trainer.compact.data import LabeledItem
    from plugsearch.trainer.compact.rl import reinforce
    from tests.unit.test_searcher_compact import NAME_SEEKER, QUESTION, MemoryRetriever

    answered: list[int] = []

    class Services(FakeStack):
        async def answer_and_judge(self, items: Sequence[tuple[str, Sequence[Document], Sequence[str]]]
                                   ) -> list[Answered]:
            answered.append(len(items))
            await asyncio.sleep(0.05)  # the services' time, which the step's log must report
            return [Answered("Greenwich Village", float(any("Greenwich" in d.text for d in docs)), 0.0, 0.0, "span")
                    for _, docs, _ in items]

    retriever = MemoryRetriever()
    train = [LabeledItem(QAItem(id="q", question=QUESTION, golden_answers=["Greenwich Village"]))]
    config = CompactConfig(retrieve_k=3, select_k=2, max_turns=1, rl_steps=1, questions_per_step=1, group=2,
                           hidden=(2, 2), dense=False, reward="gbr")
    store = BaselineStore(tmp_path / "baselines", BaselineConfig(k=3, method="bm25"))
    policy, entries = reinforce(NAME_SEEKER, train, retriever, config, tmp_path, lambda: RewardComputer(
        Services({}), kind="gbr", baseline="same_n", baselines=store, method="bm25", retriever=retriever))
    (entry,) = entries
    # naive RAG's documents (the Big Stone Gap pool) never hold the answer: the reward is the searches' GenAcc
    assert entry["kind"] == "gbr" and entry["mean_reward"] == entry["mean_genacc"]
    assert answered == [2, 1]  # the group's two answers, and the naive baseline (computed once, then stored)
    assert set(store.with_k(2).genacc_by_id()) == {"q"}
    assert entry["service_seconds"] > 0 and 0 < entry["service_share"] <= 1
    assert json.loads((tmp_path / "rewards.jsonl").read_text())["step"] == 0
