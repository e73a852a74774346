"""Judge logic against scripted LLMs: modes, verdict parsing, retry, undecided, cache, concurrency."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from typing import Any

import pytest

from plugsearch.common.cache import MemoryCache, ResultCache
from plugsearch.common.errors import UpstreamError, UpstreamTimeout
from plugsearch.common.llm import ChatMessage, ChatResult
from plugsearch.common.metrics import ServiceMetrics
from plugsearch.common.schemas.judge import JudgeRequest
from plugsearch.judge.prompts import load_prompt
from plugsearch.judge.serving import Judge, format_answers, parse_verdict
from tests.gate import ScriptedBase

_PROMPT = re.compile(r"following response: (?P<response>.*)\n\nGolden answers: (?P<answers>\[.*\])\n", re.S)
EQUIVALENT = {"twenty-five": "25", "kilograms": "kg", "the first black us president": "barack obama"}


def oracle(prompt: str) -> str:
    """A stand-in for a capable judge: reads the prompt, knows a few number/unit/paraphrase equivalences."""
    match = _PROMPT.search(prompt)
    assert match, prompt
    response = match["response"].lower()
    for phrase, canonical in EQUIVALENT.items():
        response = response.replace(phrase, canonical)
    answers = ast.literal_eval(match["answers"])
    return "Yes." if any(a.lower() in response for a in answers) else "No."


class ScriptedLLM(ScriptedBase):
    model = "scripted-judge"

    def __init__(self, reply: Callable[[str], str] = oracle, delay_s: float = 0.0,
                 error: Exception | None = None, gate: int = 0) -> None:
        super().__init__(delay_s, gate)
        self.reply = reply
        self.error = error
        self.prompts: list[str] = []

    async def chat(self, messages: list[ChatMessage], *, temperature: float = 0.0, max_tokens: int = 256,
                   stop: list[str] | None = None, extra: dict[str, Any] | None = None) -> ChatResult:
        assert temperature == 0.0 and max_tokens == 10
        self.prompts.append(messages[-1].content)
        async with self.in_flight():
            if self.error is not None:
                raise self.error
            return ChatResult(text=self.reply(messages[-1].content))


def make(llm: ScriptedLLM) -> Judge:
    return Judge(llm, ResultCache(MemoryCache(), name="judge"), load_prompt("v1"), metrics=ServiceMetrics("judge"))


def req(prediction: str, answers: list[str], mode: str = "genacc") -> JudgeRequest:
    return JudgeRequest(prediction=prediction, golden_answers=answers, mode=mode)  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "verdict"), [
    ("yes", True), ("Yes.", True), (" YES, it is", True), ("no", False), ("No, it is not.", False),
    ("True", True), ("false", False), ("The answer: yes", True), ("eyes nose", None), ("", None),
    ("I cannot tell", None), ("no... well yes", False),
])
def test_parse_verdict(text: str, verdict: bool | None) -> None:
    assert parse_verdict(text) is verdict


async def test_s3_worked_examples() -> None:
    llm = ScriptedLLM()
    judge = make(llm)
    obama = await judge.judge(req("Barack Obama", ["Obama"]))
    assert (obama.score, obama.decided_by) == (1.0, "span") and not llm.prompts  # no LLM call
    trap = await judge.judge(req("not true", ["true"]))
    assert (trap.score, trap.decided_by) == (1.0, "span")  # the documented span false positive
    para = await judge.judge(req("The first black US president", ["Barack Obama"]))
    assert (para.score, para.decided_by) == (1.0, "llm")  # paraphrase falls to the judge
    for prediction, gold in (("twenty-five", "25"), ("3 kilograms", "3 kg")):
        result = await judge.judge(req(prediction, [gold]))
        assert (result.score, result.genacc, result.decided_by) == (1.0, 1.0, "llm"), prediction
        assert result.em == 0.0
    wrong = await judge.judge(req("Marseille", ["Paris"]))
    assert (wrong.score, wrong.decided_by) == (0.0, "llm")
    assert len(llm.prompts) == 4
    assert "following response: Marseille\n\nGolden answers: ['Paris']" in llm.prompts[-1]


async def test_modes() -> None:
    llm = ScriptedLLM(reply=lambda p: "no")
    judge = make(llm)
    em = await judge.judge(req("the Paris", ["Paris"], "em"))
    assert (em.score, em.decided_by, em.genacc) == (1.0, "em", None)
    f1 = await judge.judge(req("Paris France", ["Paris"], "f1"))
    assert f1.decided_by == "f1" and f1.score == pytest.approx(2 / 3) and f1.f1 == f1.score
    span = await judge.judge(req("in Paris, France", ["Paris"], "span"))
    assert (span.score, span.decided_by, span.em) == (1.0, "span", 0.0)
    assert not llm.prompts
    llm_only = await judge.judge(req("Paris", ["Paris"], "llm"))  # llm mode asks even when the span matches
    assert (llm_only.score, llm_only.decided_by) == (0.0, "llm") and len(llm.prompts) == 1


async def test_unclear_reply_is_asked_once_more_then_scored_zero() -> None:
    replies = iter(["hmm", "yes"])
    llm = ScriptedLLM(reply=lambda p: next(replies))
    result = await make(llm).judge(req("Lutetia", ["Paris"]))
    assert (result.score, result.decided_by, result.reason) == (1.0, "llm", None)
    assert len(llm.prompts) == 2 and "exactly one word" in llm.prompts[1]
    never = ScriptedLLM(reply=lambda p: "maybe")
    doubtful = await make(never).judge(req("Lutetia", ["Paris"]))
    assert doubtful.score == 0.0 and doubtful.reason and len(never.prompts) == 2


async def test_llm_failure_genacc_undecided_llm_mode_raises() -> None:
    judge = make(ScriptedLLM(error=UpstreamError("judge_llm unreachable: ConnectError")))
    results = await judge.judge_batch([req("Paris", ["Paris"]), req("Lutetia", ["Paris"])])
    assert (results[0].score, results[0].decided_by) == (1.0, "span")
    assert (results[1].score, results[1].genacc, results[1].decided_by) == (None, None, "undecided")
    assert "unreachable" in (results[1].reason or "")
    with pytest.raises(UpstreamError):
        await judge.judge(req("Lutetia", ["Paris"], "llm"))
    with pytest.raises(UpstreamTimeout):
        await make(ScriptedLLM(error=UpstreamTimeout("slow"))).judge_batch([req("a", ["b"], "llm")])


async def test_verdicts_are_cached_and_shared_in_flight() -> None:
    llm = ScriptedLLM(delay_s=0.05)
    judge = make(llm)
    results = await judge.judge_batch([req("twenty-five", ["25"])] * 5)
    assert all(r.score == 1.0 for r in results) and len(llm.prompts) == 1
    again = await judge.judge(req("twenty-five", ["25"]))
    assert again.cached and again.score == 1.0 and len(llm.prompts) == 1
    await judge.judge(req("twenty-five", ["25", "xxv"]))  # other answers: another key
    assert len(llm.prompts) == 2


async def test_batch_runs_concurrently_in_order() -> None:
    llm = ScriptedLLM(gate=30)
    items = [req(f"number {i}", [str(i + 1)]) for i in range(30)]
    results = await make(llm).judge_batch(items)
    assert [r.decided_by for r in results] == ["llm"] * 30 and llm.peak == 30


def test_answers_are_written_as_s3_does() -> None:
    assert format_answers(["Paris", "City of Light"]) == "['Paris', 'City of Light']"


async def test_malformed_cache_entries_are_recomputed() -> None:
    llm = ScriptedLLM()
    judge = make(llm)
    key = judge.verdict_key("twenty-five", ["25"])
    await judge.cache.set_json(key, {"correct": "maybe"})
    result = await judge.judge(req("twenty-five", ["25"]))
    assert result.score == 1.0 and not result.cached and len(llm.prompts) == 1
