"""GenAcc, EM and F1: the judge's logic (s3's `check_answer_correct`; modes, retry and failure handling:
plugsearch/judge/README.md). Knows nothing of FastAPI.

When the LLM fails, `llm` mode raises (502/504) and `genacc` mode returns the items the span check did not
decide as `undecided`, never as wrong. LLM verdicts are cached; identical questions in flight at once share
one LLM call. A batch runs its items concurrently (the LLM client's semaphore bounds how many reach the LLM
at once), where s3's reward loop judges one item after another.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from dataclasses import KW_ONLY, InitVar, dataclass, field

from prometheus_client import Counter

from plugsearch.common.aio import run_all
from plugsearch.common.answers import exact_match, f1_score, span_match
from plugsearch.common.cache import ResultCache, cache_key
from plugsearch.common.errors import ServiceError
from plugsearch.common.llm import ChatMessage, LLMBackend
from plugsearch.common.metrics import ServiceMetrics
from plugsearch.common.schemas.judge import JudgeRequest, JudgeResult
from plugsearch.judge.prompts import JudgePrompt

logger = logging.getLogger(__name__)

_VERDICT = re.compile(r"\b(yes|no|true|false)\b", re.IGNORECASE)


def parse_verdict(text: str) -> bool | None:
    """The first standalone yes/no (or true/false) in the reply; None when there is none."""
    match = _VERDICT.search(text)
    return None if match is None else match.group(1).lower() in ("yes", "true")


def format_answers(golden_answers: Sequence[str]) -> str:
    """As s3 writes them into the prompt: `str(gold_answers)`, a Python list literal."""
    return str(list(golden_answers))


@dataclass(frozen=True)
class Verdict:
    correct: bool
    clear: bool
    cached: bool = False


@dataclass(eq=False)
class Judge:
    llm: LLMBackend
    cache: ResultCache
    prompt: JudgePrompt
    _: KW_ONLY
    metrics: InitVar[ServiceMetrics]
    verdict_max_tokens: int = 10
    _inflight: dict[str, asyncio.Future[Verdict]] = field(default_factory=dict, init=False)

    def __post_init__(self, metrics: ServiceMetrics) -> None:
        self._decisions = Counter("judge_decisions_total", "judged items", ["mode", "decided_by"],
                                  registry=metrics.registry)
        self._unclear = Counter("judge_llm_unclear_total", "LLM replies that were neither yes nor no",
                                ["attempt"], registry=metrics.registry)

    def verdict_key(self, prediction: str, golden_answers: Sequence[str]) -> str:
        return cache_key("judge", {"model": self.llm.model, "prompt": self.prompt.version,
                                   "prediction": prediction, "answers": list(golden_answers)})

    async def llm_verdict(self, prediction: str, golden_answers: Sequence[str]) -> Verdict:
        """Cached, shared while in flight; raises the LLM client's ServiceError when the LLM fails."""
        key = self.verdict_key(prediction, golden_answers)
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.ensure_future(self._verdict(key, prediction, golden_answers))
            self._inflight[key] = task
            task.add_done_callback(lambda _: self._inflight.pop(key, None))
            # marks its exception retrieved: the waiters may all have gone away
            task.add_done_callback(lambda done: done.cancelled() or done.exception())
        return await asyncio.shield(task)

    async def _verdict(self, key: str, prediction: str, golden_answers: Sequence[str]) -> Verdict:
        hit = await self.cache.get_json(key)
        if isinstance(hit, dict) and isinstance(hit.get("correct"), bool) and isinstance(hit.get("clear"), bool):
            return Verdict(correct=hit["correct"], clear=hit["clear"], cached=True)
        if hit is not None:
            logger.warning("ignoring a malformed cached verdict under %s", key)
        values = {"response": prediction, "golden_answers": format_answers(golden_answers)}
        verdict: bool | None = None
        for attempt, template in enumerate((self.prompt.user, self.prompt.retry)):
            reply = await self.llm.chat([ChatMessage(role="user", content=template.substitute(values))],
                                        temperature=0.0, max_tokens=self.verdict_max_tokens)
            verdict = parse_verdict(reply.text)
            if verdict is not None:
                break
            logger.info("judge reply without yes/no (attempt %s): %r", attempt + 1, reply.text[:80])
            self._unclear.labels(str(attempt + 1)).inc()
        result = Verdict(correct=bool(verdict), clear=verdict is not None)
        await self.cache.set_json(key, {"correct": result.correct, "clear": result.clear})
        return result

    async def judge(self, request: JudgeRequest) -> JudgeResult:
        prediction, answers = request.prediction, list(request.golden_answers)
        em = exact_match(prediction, answers)
        f1 = f1_score(prediction, answers)
        mode = request.mode
        result: JudgeResult
        if mode == "em" or mode == "f1":
            result = JudgeResult(score=em if mode == "em" else f1, em=em, f1=f1, decided_by=mode)
        elif mode == "span":
            span = float(span_match(prediction, answers))
            result = JudgeResult(score=span, em=em, f1=f1, decided_by="span")
        elif mode == "llm":
            verdict = await self.llm_verdict(prediction, answers)  # LLM failure -> 502/504
            result = self._from_verdict(verdict, em, f1)
        elif span_match(prediction, answers):  # genacc, span success
            result = JudgeResult(score=1.0, genacc=1.0, em=em, f1=f1, decided_by="span")
        else:  # genacc, span failed: ask the LLM; if it fails, undecided (never "wrong")
            try:
                verdict = await self.llm_verdict(prediction, answers)
            except ServiceError as exc:
                result = JudgeResult(score=None, genacc=None, em=em, f1=f1, decided_by="undecided",
                                     reason=f"span check failed and the judge LLM failed: {exc.message}")
            else:
                result = self._from_verdict(verdict, em, f1)
        self._decisions.labels(mode, result.decided_by).inc()
        return result

    @staticmethod
    def _from_verdict(verdict: Verdict, em: float, f1: float) -> JudgeResult:
        score = float(verdict.correct)
        reason = None if verdict.clear else "judge LLM answered neither yes nor no twice; scored 0"
        return JudgeResult(score=score, genacc=score, em=em, f1=f1, decided_by="llm", reason=reason,
                           cached=verdict.cached)

    async def judge_batch(self, requests: Sequence[JudgeRequest]) -> list[JudgeResult]:
        """All items concurrently, results in request order. An `llm`-mode item whose LLM call fails
        fails the batch (the rest are cancelled); `genacc` items never do."""
        return await run_all([self.judge(r) for r in requests])
