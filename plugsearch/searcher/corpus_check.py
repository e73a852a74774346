"""Does the served policy beat naive BM25 top-k on this corpus? Measured, not assumed, before it serves one.

A compact policy is trained on one kind of corpus (the shipped one on Wikipedia: titles name entities, a
capitalised name is the next hop). On a corpus unlike it (research articles, annual reports) its features can
mislead it and it can return fewer answers than naive BM25 top-k at the same number of documents. So the
searcher measures itself on the served corpus (`check_policy`): pseudo-questions made from a sample of the
corpus's own passages (`plugsearch.searcher.pseudo_questions.check_questions`: a cloze over one sentence, or, where
another document mentions the passage's title, a two-passage question through that mention, at the corpus's own
rate of such links), each searched by the policy in its setting and by naive BM25 top-`select_k`, answer recall
of both (a returned document holds the answer: GenAcc's span check), and the paired difference with a bootstrap
interval. The policy serves only where it is not worse:
its mean difference at least `-margin` (`SEARCHER_CORPUS_CHECK_MARGIN`); elsewhere s3 searches return naive
BM25 top-k, say so in the response (`fallback`) and `/version`, and the log says why. Seconds on ~200
questions (a compact search is tens of milliseconds).

Where the policy's own evaluation already covers the corpus (its manifest's `evaluation` with `beats_naive`,
measured on real questions of the same corpus: the shipped policy on the shared Wikipedia corpus, a policy
trained by `plugsearch-train compact` on its user's corpus), that verdict stands and no check runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from plugsearch.common.answers import span_match
from plugsearch.common.schemas.searcher import SearchParams
from plugsearch.searcher.env import RetrieverBackend
from plugsearch.searcher.loop import ActingPolicy, run_search
from plugsearch.searcher.pseudo_questions import PseudoQuestion, check_questions, describe

logger = logging.getLogger(__name__)
Decision = Literal["policy", "naive"]
MIN_QUESTIONS = 30
"""Fewer pseudo-questions than this measure nothing: the corpus is too small or too uniform to check."""


@dataclass
class CheckResult:
    """What the check measured and decided (`/version`'s `details.corpus_check`)."""

    decision: Decision
    reason: str
    questions: int = 0
    policy_recall: float = 0.0
    naive_recall: float = 0.0
    difference: float = 0.0
    interval: list[float] = field(default_factory=lambda: [0.0, 0.0])
    margin: float = 0.0
    searches_per_question: float = 0.0
    seconds: float = 0.0
    kinds: dict[str, int] = field(default_factory=dict)
    by_kind: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per kind of pseudo-question: the policy's and naive's answer recall."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def paired_interval(diffs: Sequence[float], *, resamples: int = 2000, seed: int = 0) -> list[float]:
    """95% percentile bootstrap interval of the mean of `diffs` (fixed seed)."""
    if not diffs:
        return [0.0, 0.0]
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return [round(means[int(0.025 * resamples)], 3), round(means[int(0.975 * resamples) - 1], 3)]


async def check_policy(policy: ActingPolicy, params: SearchParams, retriever: RetrieverBackend,
                       questions: Sequence[PseudoQuestion], *, margin: float = 0.0) -> CheckResult:
    """The policy (searching with `params`, mode s3) against naive BM25 top-`params.select_k` on `questions`:
    `policy` when its mean answer-recall difference is at least `-margin`, else `naive`."""
    t0 = time.perf_counter()
    if len(questions) < MIN_QUESTIONS:
        return CheckResult("naive", f"only {len(questions)} pseudo-questions could be made from the corpus "
                           f"(at least {MIN_QUESTIONS} are needed to measure the policy): too small or too "
                           "uniform to check, naive BM25 top-k serves", questions=len(questions), margin=margin,
                           seconds=time.perf_counter() - t0, kinds=describe(questions))
    k = params.select_k
    naive_docs = await retriever.retrieve([q.question for q in questions], k, "bm25")
    diffs, policy_hits, naive_hits, searches = [], 0, 0, 0
    per_kind: dict[str, list[float]] = {}
    for q, naive in zip(questions, naive_docs, strict=True):
        outcome = await run_search(q.question, params, policy=policy, retriever=retriever)
        hit_p = any(span_match(d.text, [q.answer]) for d in outcome.documents[:k])
        hit_n = any(span_match(d.text, [q.answer]) for d in naive[:k])
        policy_hits += hit_p
        naive_hits += hit_n
        searches += len(outcome.queries)
        diffs.append(float(hit_p) - float(hit_n))
        tally = per_kind.setdefault(q.kind, [0.0, 0.0, 0.0])
        tally[0] += 1
        tally[1] += hit_p
        tally[2] += hit_n
    n = len(questions)
    by_kind = {kind: {"n": t[0], "policy": round(t[1] / t[0], 3), "naive": round(t[2] / t[0], 3)}
               for kind, t in sorted(per_kind.items())}
    diff = sum(diffs) / n
    interval = paired_interval(diffs)
    decision: Decision = "policy" if diff >= -margin else "naive"
    said = (f"the policy found the answer of {policy_hits} of {n} pseudo-questions of this corpus, naive BM25 "
            f"top-{k} {naive_hits} (difference {diff:+.3f}, 95% interval [{interval[0]:+.3f}, {interval[1]:+.3f}])")
    reason = (f"{said}: the policy serves" if decision == "policy"
              else f"{said}: below naive by more than {margin:g}, so naive BM25 top-{k} serves s3 searches "
                   "(SEARCHER_CORPUS_CHECK=off serves the policy anyway)")
    return CheckResult(decision, reason, questions=n, policy_recall=round(policy_hits / n, 4),
                       naive_recall=round(naive_hits / n, 4), difference=round(diff, 4), interval=interval,
                       margin=margin, searches_per_question=round(searches / n, 3),
                       seconds=round(time.perf_counter() - t0, 3), kinds=describe(questions), by_kind=by_kind)


Sampler = Callable[[int, int], Awaitable[list[tuple[str, str, str]]]]
"""(n, seed) -> up to `n` passages `(id, title, text)` drawn at random from the served corpus."""


def evaluated_here(manifest: Mapping[str, Any], corpus_sha256: str | None) -> bool | None:
    """The verdict of the policy's own evaluation on the served corpus, when it has one (`beats_naive` of a policy
    trained and evaluated on labelled questions of this corpus: its manifest's bound `corpus`), else None."""
    corpus = manifest.get("corpus")
    evaluation = manifest.get("evaluation")
    if not isinstance(corpus, Mapping) or not corpus.get("bound") or not isinstance(evaluation, Mapping) \
            or corpus_sha256 is None:
        return None
    if str(corpus.get("sha256") or "") != corpus_sha256.split(":", 1)[-1]:
        return None
    if evaluation.get("questions") == "pseudo":
        # trained and evaluated on questions made from the corpus: the check's questions are of the same kind,
        # so they cannot vouch for it (on the development sets such policies passed them and lost on real
        # questions): not served unless the operator says so
        return False
    verdict = evaluation.get("beats_naive")
    return verdict if isinstance(verdict, bool) else None


class CorpusGate:
    """The check, once per served index: `verdict(index_id, params)` is the result for that index and pool, and
    starts the check the first time it is asked; while that check runs, the last verdict (of the index this one
    replaced) stands, and before any verdict (None) the caller serves naive. A check that cannot run (the
    retriever cannot sample passages, a search fails) is retried after `retry_s`; meanwhile naive serves."""

    def __init__(self, policy: ActingPolicy, retriever: RetrieverBackend, sample: Sampler, *, questions: int = 200,
                 margin: float = 0.0, seed: int = 0, manifest: Mapping[str, Any] | None = None,
                 retry_s: float = 30.0) -> None:
        self.policy = policy
        self.retriever = retriever
        self.sample = sample
        self.questions = questions
        self.margin = margin
        self.seed = seed
        self.manifest = manifest or {}
        self.retry_s = retry_s
        self.results: dict[tuple[str, tuple[str, ...]], CheckResult] = {}
        self._failed: dict[tuple[str, tuple[str, ...]], tuple[float, str]] = {}
        self._running: dict[tuple[str, tuple[str, ...]], asyncio.Task[None]] = {}
        self.last: CheckResult | None = None
        """The most recent verdict (what `/version` shows, and what serves while a new index is checked)."""

    @staticmethod
    def key(index_id: str, params: SearchParams) -> tuple[str, tuple[str, ...]]:
        return index_id, tuple(params.pool_methods or [params.method or "bm25"])

    def verdict(self, index_id: str, params: SearchParams, corpus_sha256: str | None = None) -> CheckResult | None:
        key = self.key(index_id, params)
        found = self.results.get(key)
        if found is not None:
            return found
        evaluated = evaluated_here(self.manifest, corpus_sha256)
        if evaluated is not None:
            pseudo = (self.manifest.get("evaluation") or {}).get("questions") == "pseudo"
            result = CheckResult("policy" if evaluated else "naive", (
                "the policy was trained and evaluated on this corpus: its evaluation says it beats naive top-k"
                if evaluated else
                ("the policy was trained and evaluated on questions made from this corpus only, which do not show "
                 "how it does on real questions (pseudo-question checks cannot either): " if pseudo else
                 "the policy's own evaluation on this corpus says it does not beat naive top-k: ") +
                "naive BM25 top-k serves s3 searches (SEARCHER_CORPUS_CHECK=off serves the policy anyway)"))
            self._settle(key, result)
            return result
        failed = self._failed.get(key)
        if key not in self._running and (failed is None or time.monotonic() - failed[0] >= self.retry_s):
            task = asyncio.get_running_loop().create_task(self._run(key, params))
            self._running[key] = task
            task.add_done_callback(lambda _: self._running.pop(key, None))
        # while the new index (the dense index loaded, the corpus changed) is checked, the last verdict stands
        return self.last

    @property
    def ready(self) -> bool:
        """Whether searches get a verdict (a check ended, or could not run and naive serves): readiness waits."""
        return self.last is not None or bool(self._failed)

    def pending_reason(self, index_id: str, params: SearchParams) -> str:
        failed = self._failed.get(self.key(index_id, params))
        if failed is not None:
            return f"the corpus check could not run ({failed[1]}); it is retried; naive BM25 top-k serves meanwhile"
        return "the corpus check of this index is running (seconds); naive BM25 top-k serves meanwhile"

    def _settle(self, key: tuple[str, tuple[str, ...]], result: CheckResult) -> None:
        self.results[key] = result
        self._failed.pop(key, None)
        self.last = result
        log = logger.info if result.decision == "policy" else logger.warning
        log("corpus check of index %s (pool %s): %s", key[0], "+".join(key[1]), result.reason)

    async def _run(self, key: tuple[str, tuple[str, ...]], params: SearchParams) -> None:
        try:
            t0 = time.perf_counter()
            passages = await self.sample(self.questions * 2, self.seed)
            questions = await check_questions(passages, self.retriever, self.questions, seed=self.seed)
            result = await check_policy(self.policy, params.model_copy(update={"timeout_s": None}), self.retriever,
                                        questions, margin=self.margin)
            result.seconds = round(time.perf_counter() - t0, 3)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the check must never take the service down; retried later
            message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
            logger.warning("corpus check of index %s could not run: %s (retried in %.0f s)", key[0], message,
                           self.retry_s)
            self._failed[key] = (time.monotonic(), str(message))
            return
        self._settle(key, result)

    def describe(self) -> dict[str, Any]:
        """What `/version` shows: the latest verdict and whether a check is running."""
        return {"state": "running" if self._running else ("done" if self.last is not None else "not run"),
                "last": self.last.as_dict() if self.last is not None else None}

    async def settled(self) -> None:
        """Wait for the checks running now to end (tests, tools)."""
        while self._running:
            await asyncio.gather(*self._running.values(), return_exceptions=True)

    async def aclose(self) -> None:
        for task in list(self._running.values()):
            task.cancel()
        for task in list(self._running.values()):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
