"""The corpus check: pseudo-questions made from passages (answer a span of the passage, never a title word, not
the whole sentence), the check's verdict from paired answer recall (a policy that loses to naive BM25 on the
corpus is refused, one that matches it serves), a corpus too small to check, and the gate that remembers a
verdict per served index, serves naive while its check runs or cannot run, and trusts the policy's own
evaluation on its own corpus."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from plugsearch.common.schemas.base import Document
from plugsearch.common.schemas.searcher import SearchParams
from plugsearch.searcher.corpus_check import (
    MIN_QUESTIONS,
    CheckResult,
    CorpusGate,
    check_policy,
    evaluated_here,
    read_labelled,
    settle,
)
from plugsearch.searcher.env import Action, SearchEnv
from plugsearch.searcher.pseudo_questions import (
    PseudoQuestion,
    bridge_question,
    check_questions,
    question_from,
)

PASSAGES = [
    ("p1", "Big Stone Gap (film)", "Big Stone Gap is a romantic comedy film directed by Adriana Trigiani. "
     "It was released in cinemas across the United States in October 2014 after a premiere in Virginia."),
    ("p2", "Annual report", "Revenue from the cloud segment grew by 12.5% in fiscal 2019, driven by new "
     "contracts with government customers and higher subscription renewals across all regions."),
    ("p3", "Privacy policy", "we share data with partners."),
]


def test_a_pseudo_question_hides_its_answer_and_keeps_part_of_the_sentence() -> None:
    rng = random.Random(0)
    q = question_from(*PASSAGES[0], rng)
    assert q is not None and q.passage_id == "p1"
    assert q.answer in PASSAGES[0][2] and q.answer not in q.question
    assert not {w.lower() for w in q.answer.split()} & {"big", "stone", "gap", "film"}  # never the title's words
    words = q.question.rstrip("?").split()
    assert words[0] in ("who", "what", "which", "when", "how")
    sentence_words = set(PASSAGES[0][2].replace(".", " ").split())
    content = [w for w in words[1:] if w not in ("many", "much")]
    assert 3 <= len(content) < len(sentence_words) and set(content) <= sentence_words


def single_questions(passages: list[tuple[str, str, str]], n: int, seed: int) -> list[PseudoQuestion]:
    """`check_questions` over passages whose titles no passage mentions: single-passage questions only."""
    docs = [Document(id=pid, title=title, text=text) for pid, title, text in passages]
    return asyncio.run(check_questions(passages, Lookup(docs), n, seed=seed))


def test_numbers_and_years_are_answers_too_and_short_passages_give_none() -> None:
    questions = single_questions(PASSAGES[1:2] * 20, 20, seed=3)
    assert {q.kind for q in questions} <= {"number", "year", "name"}
    assert any(q.kind in ("number", "year") for q in questions)
    assert all(q.answer in PASSAGES[1][2] for q in questions)
    assert question_from(*PASSAGES[2], random.Random(0)) is None  # nothing to ask in a short sentence
    assert single_questions(PASSAGES, 10, seed=0) == single_questions(PASSAGES, 10, seed=0)  # deterministic


def test_a_bridge_question_needs_the_mention_and_hides_the_bridging_name() -> None:
    answer = ("a1", "Adriana Trigiani", "Adriana Trigiani is an American writer and director who has lived in "
              "Greenwich Village since the early eighties with her family.")
    bridge = ("b1", "Big Stone Gap (film)", "Big Stone Gap is a romantic comedy film written and directed by "
              "Adriana Trigiani and produced in the mountains of southwest Virginia.")
    elsewhere = ("c1", "Pebble", "A pebble is a small piece of rock worn smooth by water over many years.")
    q = None
    for seed in range(20):
        q = bridge_question(answer, bridge, random.Random(seed))
        if q is not None:
            break
    assert q is not None and q.kind == "bridge" and q.passage_id == "a1"
    assert q.answer in answer[2] and q.answer not in bridge[2]
    assert "Adriana" not in q.question and "Trigiani" not in q.question
    assert set(q.question.rstrip("?").split()[1:]) & {"romantic", "comedy", "film", "written", "directed",
                                                      "produced", "mountains", "southwest", "Virginia", "Big",
                                                      "Stone", "Gap"}
    assert all(bridge_question(answer, elsewhere, random.Random(s)) is None for s in range(5))  # no mention
    assert all(bridge_question(answer, answer, random.Random(s)) is None for s in range(5))  # its own title

    async def questions() -> list[PseudoQuestion]:
        return await check_questions([answer, elsewhere], Lookup([Document(id=d[0], title=d[1], text=d[2])
                                                                  for d in (answer, bridge, elsewhere)]), 10)

    made = asyncio.run(questions())
    kinds = {q.passage_id: q.kind for q in made}
    assert kinds.get("a1") == "bridge" and kinds.get("c1", "none") != "bridge"


class Lookup:
    """BM25 stand-in: a query's documents are those whose text shares the most words with it."""

    def __init__(self, docs: list[Document]) -> None:
        self.docs = docs
        self.calls = 0

    async def retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        self.calls += 1
        out = []
        for q in queries:
            words = set(q.lower().split())
            ranked = sorted(self.docs, key=lambda d: -len(words & set(d.text.lower().split())))
            out.append(ranked[:k])
        return out


class LastPolicy:
    """Returns the pool's last `select_k` documents: worse than BM25's first ones."""

    model = "last"

    async def act(self, env: SearchEnv) -> Action:
        n = len(env.blocks[0].documents)
        k = env.params.select_k
        return Action("complete", selected=tuple((0, p) for p in range(n - k + 1, n + 1)))


class FirstPolicy(LastPolicy):
    """Returns BM25's first `select_k`: exactly naive."""

    model = "first"

    async def act(self, env: SearchEnv) -> Action:
        return Action("complete", selected=tuple((0, p) for p in range(1, env.params.select_k + 1)))


def corpus(n: int) -> tuple[list[Document], list[PseudoQuestion]]:
    docs = [Document(id=f"d{i}", title=f"t{i}", text=f"alpha{i} beta{i} gamma{i} delta{i} Answer{i}")
            for i in range(n)]
    questions = [PseudoQuestion(f"what alpha{i} beta{i} gamma{i}?", f"Answer{i}", f"d{i}", "name") for i in range(n)]
    return docs, questions


PARAMS = SearchParams(mode="s3", retrieve_k=6, select_k=2, max_turns=0)


def test_a_policy_that_loses_to_naive_bm25_on_the_corpus_is_refused_one_that_matches_it_serves() -> None:
    docs, questions = corpus(MIN_QUESTIONS + 10)
    worse = asyncio.run(check_policy(LastPolicy(), PARAMS, Lookup(docs), questions))
    assert worse.decision == "naive" and worse.naive_recall == 1.0 and worse.policy_recall == 0.0
    assert worse.interval[1] < 0 and "naive BM25 top-2 serves" in worse.reason
    same = asyncio.run(check_policy(FirstPolicy(), PARAMS, Lookup(docs), questions))
    assert same.decision == "policy" and same.difference == 0.0 and same.questions == len(questions)


def test_too_few_pseudo_questions_measure_nothing_and_naive_serves() -> None:
    docs, questions = corpus(MIN_QUESTIONS - 1)
    result = asyncio.run(check_policy(FirstPolicy(), PARAMS, Lookup(docs), questions))
    assert result.decision == "naive" and "too small or too uniform" in result.reason


def test_the_gate_checks_once_per_index_and_serves_naive_while_it_runs() -> None:
    docs, _ = corpus(80)
    sampled: list[int] = []

    async def sample(n: int, seed: int) -> list[tuple[str, str, str]]:
        sampled.append(n)
        return [(d.id, d.title, f"The report says {d.text.split()[0]} rose after Project Falcon{d.id} began "
                 f"in the northern plant") for d in docs[:n]]

    async def scenario() -> tuple[object, object, object, object]:
        gate = CorpusGate(LastPolicy(), Lookup(docs), sample, questions=40)
        first = gate.verdict("idx-1", PARAMS)
        pending = gate.pending_reason("idx-1", PARAMS)
        await gate.settled()
        second = gate.verdict("idx-1", PARAMS)
        again = gate.verdict("idx-1", PARAMS)
        other = gate.verdict("idx-2", PARAMS)  # another index: checked anew, the last verdict stands meanwhile
        assert gate._running
        await gate.aclose()
        return first, pending, second, (again, other)

    first, pending, second, (again, other) = asyncio.run(scenario())
    assert first is None and "running" in str(pending)
    assert second is not None and again is second and other is second
    assert sampled[0] == 80  # twice the questions asked (the second check is cancelled by aclose)


def test_a_failing_check_is_retried_later_and_naive_serves_meanwhile() -> None:
    async def broken(n: int, seed: int) -> list[tuple[str, str, str]]:
        raise RuntimeError("no sample endpoint")

    async def scenario() -> tuple[object, str]:
        gate = CorpusGate(FirstPolicy(), Lookup([]), broken, retry_s=60)
        gate.verdict("idx", PARAMS)
        await gate.settled()
        verdict = gate.verdict("idx", PARAMS)  # within retry_s: not started again
        return verdict, gate.pending_reason("idx", PARAMS)

    verdict, reason = asyncio.run(scenario())
    assert verdict is None and "could not run" in reason and "no sample endpoint" in reason


@pytest.mark.parametrize(("beats", "decision"), [(True, "policy"), (False, "naive")])
def test_a_policy_evaluated_on_the_served_corpus_keeps_its_own_verdict(beats: bool, decision: str) -> None:
    manifest = {"corpus": {"bound": True, "sha256": "abc"}, "evaluation": {"beats_naive": beats}}
    assert evaluated_here(manifest, "sha256:abc") is beats
    assert evaluated_here(manifest, "sha256:other") is None
    assert evaluated_here({"corpus": "combined.jsonl", "evaluation": {"beats_naive": True}}, "sha256:abc") is None
    pseudo = {**manifest, "evaluation": {"beats_naive": True, "questions": "pseudo"}}
    assert evaluated_here(pseudo, "sha256:abc") is False  # made-up questions vouch for nothing: not served

    async def never(n: int, seed: int) -> list[tuple[str, str, str]]:
        raise AssertionError("no check runs where the policy's own evaluation covers the corpus")

    async def scenario() -> object:
        gate = CorpusGate(FirstPolicy(), Lookup([]), never, manifest=manifest)
        return gate.verdict("idx", PARAMS, {"corpus_checksum": "abc"})

    result = asyncio.run(scenario())
    assert result is not None and result.decision == decision  # type: ignore[attr-defined]


def measured(decision: str, interval: tuple[float, float], *, done: bool = True) -> CheckResult:
    mean = (interval[0] + interval[1]) / 2
    return CheckResult(decision, "", questions=300 if done else 3, difference=mean,  # type: ignore[arg-type]
                       interval=list(interval), measured=done)


@pytest.mark.parametrize(("old", "new", "margin", "expected"), [
    # a "policy" verdict turns "naive" only when the new interval lies wholly below -margin
    ("policy", ("naive", (-0.030, -0.001)), 0.0, ("naive", "changed")),
    ("policy", ("naive", (-0.043, +0.017)), 0.0, ("policy", "kept")),  # -0.013 after 15 writes: it stands
    ("policy", ("naive", (-0.040, -0.010)), 0.02, ("policy", "kept")),  # below 0 but not below -margin
    ("policy", ("policy", (+0.002, +0.060)), 0.0, ("policy", "confirmed")),
    # a "naive" verdict turns "policy" only when the new interval lies wholly at or above -margin
    ("naive", ("policy", (-0.010, +0.040)), 0.0, ("naive", "kept")),
    ("naive", ("policy", (0.0, +0.040)), 0.0, ("policy", "changed")),
    ("naive", ("policy", (-0.015, +0.040)), 0.02, ("policy", "changed")),
    ("naive", ("naive", (-0.060, -0.020)), 0.0, ("naive", "confirmed")),
])
def test_a_standing_verdict_changes_only_when_the_new_interval_excludes_its_side(
        old: str, new: tuple[str, tuple[float, float]], margin: float, expected: tuple[str, str]) -> None:
    assert settle(measured(old, (-0.1, 0.1)), measured(*new), margin) == expected


def test_without_a_measured_verdict_the_new_measurement_decides_and_one_that_measured_nothing_changes_nothing() -> None:
    assert settle(None, measured("naive", (-0.043, +0.017)), 0.0) == ("naive", "first")
    too_few = measured("naive", (0.0, 0.0), done=False)
    assert settle(too_few, measured("policy", (-0.02, 0.03)), 0.0) == ("policy", "first")
    assert settle(measured("policy", (0.01, 0.05)), too_few, 0.0) == ("policy", "kept")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Flipping(LastPolicy):
    """Loses to naive on every question (the pool's last documents): a new measurement clearly below naive."""


def test_the_gate_checks_again_only_after_a_material_share_changed_and_never_more_often_than_its_interval() -> None:
    docs, questions = corpus(80)

    def details(seq: int, passages: int) -> dict[str, object]:
        return {"documents": 1000, "changes": {"seq": seq, "added": seq, "replaced": 0, "deleted": 0,
                                               "passages": passages}}

    async def scenario() -> CorpusGate:
        clock = Clock()
        gate = CorpusGate(FirstPolicy(), Lookup(docs), never_sampled, labelled=questions, recheck_share=0.05,
                          min_interval_s=600, clock=clock)
        gate.verdict("base", PARAMS, details(0, 0))
        await gate.settled()
        first = gate.last
        assert first is not None and first.decision == "policy" and first.rule == "first" and gate.checks == 1
        assert first.passages == 1000 and first.changed_passages == 0
        for seq in range(1, 50):  # 49 one-passage writes: 4.9% of the corpus, and the identity moves each time
            assert gate.verdict(f"base-c{seq}", PARAMS, details(seq, seq)) is first
        assert not gate._running and gate.checks == 1
        drift = gate.describe()["since_verdict"]
        assert drift["passages_changed"] == 49 and drift["share"] == 0.049
        clock.now += 10
        gate.verdict("base-c50", PARAMS, details(50, 50))  # 5%, but 10 s after the first check: not yet
        assert not gate._running
        clock.now += 600
        gate.policy = Flipping()  # the corpus turned against the policy: the re-check finds it clearly below naive
        assert gate.verdict("base-c51", PARAMS, details(51, 51)) is first  # the re-check starts; the verdict stands
        await gate.settled()
        second = gate.last
        assert second is not None and second is not first and gate.checks == 2 and gate.rechecks == 1
        assert second.decision == "naive" and second.rule == "changed" and second.changed_passages == 51
        assert "the verdict changes" in second.reason
        assert gate.verdict("base-c52", PARAMS, details(52, 52)) is second  # measured again from 51 passages
        clock.now += 1000
        for seq in range(53, 100):  # 47 more: under 5% since the re-check
            gate.verdict(f"base-c{seq}", PARAMS, details(seq, seq))
        assert not gate._running and gate.checks == 2
        gate.verdict("other", PARAMS, details(0, 0))  # another base index (a rebuilt corpus): checked at once
        assert gate._running
        await gate.aclose()
        return gate

    gate = asyncio.run(scenario())
    assert gate.checks == 2 and gate.rechecks == 1


def test_a_recheck_that_does_not_clearly_differ_keeps_the_verdict_and_says_so() -> None:
    docs, questions = corpus(MIN_QUESTIONS + 30)

    class HalfWorse(FirstPolicy):
        """Naive's documents, except on every 25th question: the last of the pool (a small loss, not clear)."""

        async def act(self, env: SearchEnv) -> Action:
            if int(env.question.split()[1].removeprefix("alpha")) % 25 == 0:
                return await LastPolicy.act(self, env)  # type: ignore[arg-type]
            return await super().act(env)

    async def scenario() -> CheckResult:
        clock = Clock()
        gate = CorpusGate(FirstPolicy(), Lookup(docs), never_sampled, labelled=questions, min_interval_s=0,
                          clock=clock)
        details = {"documents": 100, "changes": {"seq": 0, "passages": 0}}
        gate.verdict("base", PARAMS, details)
        await gate.settled()
        assert gate.last is not None and gate.last.decision == "policy" and gate.last.kind == "labelled"
        gate.policy = HalfWorse()
        gate.verdict("base-c9", PARAMS, {"documents": 100, "changes": {"seq": 9, "passages": 9}})
        await gate.settled()
        assert gate.last is not None
        return gate.last

    result = asyncio.run(scenario())
    assert result.decision == "policy" and result.rule == "kept" and result.difference < 0
    assert result.interval[0] < 0 <= result.interval[1] and "the verdict stands" in result.reason


async def never_sampled(n: int, seed: int) -> list[tuple[str, str, str]]:
    raise AssertionError("labelled questions are given: nothing is sampled")


def test_labelled_questions_judge_the_policy_instead_of_pseudo_questions(tmp_path: Path) -> None:
    rows = [{"question": f"what alpha{i} beta{i} gamma{i}?", "golden_answers": [f"Answer{i}"]} for i in range(40)]
    rows += [{"question": f"what delta{i} gamma{i}?", "passage_ids": [f"d{i}"]} for i in range(40, 50)]
    rows += [{"question": "is it true?", "golden_answers": ["yes"]}]
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    labelled = read_labelled(path)
    assert len(labelled) == 50 and labelled[45].passage_ids == ("d45",)  # the yes/no question left out
    assert len(read_labelled(path, 10)) == 10
    docs, _ = corpus(60)
    manifest = {"corpus": {"bound": True, "sha256": "abc"}, "evaluation": {"beats_naive": True}}

    async def scenario(policy: object) -> CheckResult:
        gate = CorpusGate(policy, Lookup(docs), never_sampled, labelled=labelled, manifest=manifest)  # type: ignore[arg-type]
        gate.verdict("idx", PARAMS, {"corpus_checksum": "abc", "documents": 60})
        await gate.settled()
        assert gate.describe()["questions"] == "labelled"
        assert gate.last is not None
        return gate.last

    worse = asyncio.run(scenario(LastPolicy()))  # the labels take precedence over the policy's own evaluation
    assert worse.kind == "labelled" and worse.decision == "naive" and worse.questions == 50
    assert worse.naive_recall == 1.0 and worse.interval[1] < 0 and "labelled questions" in worse.reason
    same = asyncio.run(scenario(FirstPolicy()))
    assert same.decision == "policy" and same.kinds == {"labelled": 50}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "no answer"}\n')
    with pytest.raises(ValueError, match="line 1"):
        read_labelled(bad)


def test_the_policys_own_evaluation_is_shown_with_its_figures() -> None:
    manifest = {"corpus": {"bound": True, "sha256": "abc"}, "evaluation": {"beats_naive": True, "bench": {
        "all": {"budget3": {"answer_recall": {"compact_rl": 0.85, "naive_bm25": 0.69, "compact_rl_minus_naive": 0.155,
                                              "compact_rl_minus_naive_ci95": [0.122, 0.19]}}},
        "datasets": {"a": {"n": 200}, "b": {"n": 258}}}}}

    async def scenario() -> CheckResult | None:
        gate = CorpusGate(FirstPolicy(), Lookup([]), never_sampled, manifest=manifest)
        result = gate.verdict("idx", PARAMS, {"corpus_checksum": "sha256:abc"})
        assert gate.verdict("idx-c400", PARAMS, {"corpus_checksum": "sha256:abc", "documents": 10,
                                                 "changes": {"seq": 400, "passages": 400}}) is result
        assert not gate._running  # its own verdict is not re-checked on drift (corpus_drift advises retraining)
        return result

    result = asyncio.run(scenario())
    assert result is not None and result.kind == "policy evaluation" and result.decision == "policy"
    assert result.questions == 458 and result.interval == [0.122, 0.19] and result.difference == 0.155


def test_a_bad_labelled_question_file_refuses_to_start_the_searcher(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from plugsearch.searcher.settings import SearcherSettings

    bad = tmp_path / "qa.jsonl"
    bad.write_text('{"question": "what?", "golden_answers": ["x"]}\nnot json\n')
    with pytest.raises(ValidationError, match="corpus_check_qa: .*line 2: not valid JSON"):
        SearcherSettings(corpus_check_qa=bad)
    with pytest.raises(ValidationError, match="does not exist"):
        SearcherSettings(corpus_check_qa=tmp_path / "missing.jsonl")
    good = tmp_path / "good.jsonl"
    good.write_text('{"question": "what?", "golden_answers": ["x"]}\n')
    assert SearcherSettings(corpus_check_qa=good).corpus_check_qa == good
