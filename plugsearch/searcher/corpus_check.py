"""Does the served policy beat naive BM25 top-k on this corpus? Measured, not assumed, before it serves one.

A compact policy is trained on one kind of corpus (the shipped one on Wikipedia: titles name entities, a
capitalised name is the next hop). On a corpus unlike it (research articles, annual reports) its features can
mislead it and it can return fewer answers than naive BM25 top-k at the same number of documents. So the
searcher measures itself on the served corpus (`check_policy`), on one of three kinds of questions, best first:

- `labelled`: the operator's own labelled questions (`SEARCHER_CORPUS_CHECK_QA=FILE`, rows as `plugsearch-train
  compact --qa` reads them: `question` with `golden_answers` and / or `passage_ids`), real questions people ask
  of this corpus: a returned passage holding a gold answer, or one of the labelled passages, is a hit;
- `policy evaluation`: where the policy's own evaluation already covers the corpus (its manifest's `evaluation`
  with `beats_naive`, measured on held-back real questions of the same corpus: a policy trained by
  `plugsearch-train compact` on its user's corpus), that verdict stands and no check runs;
- `pseudo`: pseudo-questions made from a sample of the corpus's own passages
  (`plugsearch.searcher.pseudo_questions.check_questions`: a cloze over one sentence, or, where another document
  mentions the passage's title, a two-passage question through that mention, at the corpus's own rate of such
  links), the answer found by GenAcc's span check.

Each question is searched by the policy in its setting and by naive BM25 top-`select_k`: answer recall of both
and the paired difference with a bootstrap interval. The policy serves only where it is not worse: its mean
difference at least `-margin` (`SEARCHER_CORPUS_CHECK_MARGIN`); elsewhere s3 searches return naive BM25 top-k,
say so in the response (`fallback`) and `/version`, and the log says why. Seconds on ~300 questions (a compact
search is tens of milliseconds).

A verdict holds still while documents change (`CorpusGate`): the retriever's index identity moves with every put
or delete, but the check runs again only once a material share of the corpus has changed since the verdict
(`SEARCHER_CORPUS_CHECK_RECHECK_SHARE`, 5% of the passages: the retriever's `/version` counts the passages put and
deleted), at most once per `SEARCHER_CORPUS_CHECK_MIN_INTERVAL_S`, and a new measurement replaces the verdict only
when it clearly differs from it (`settle`: a `policy` verdict turns `naive` only when the new interval lies wholly
below `-margin`, a `naive` one turns `policy` only when it lies wholly at or above it). Pseudo-questions are drawn
anew from the changed corpus, so without these rules every write could flip what every caller gets (on the shared
Wikipedia corpus with the BM25 pool, +0.017 [-0.017, +0.050] measured afresh after 750 small writes read -0.017
[-0.060, +0.023]: `bench/verdict_stability.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from plugsearch.common.answers import is_yes_no, span_match
from plugsearch.common.schemas.base import Document
from plugsearch.common.schemas.searcher import SearchParams
from plugsearch.common.stats import bootstrap_interval
from plugsearch.searcher.env import RetrieverBackend
from plugsearch.searcher.loop import ActingPolicy, run_search
from plugsearch.searcher.pseudo_questions import check_questions

logger = logging.getLogger(__name__)
Decision = Literal["policy", "naive"]
Kind = Literal["pseudo", "labelled", "policy evaluation"]
MIN_QUESTIONS = 30
"""Fewer questions than this measure nothing: the corpus is too small or too uniform to check."""
MADE_UP = frozenset({"pseudo", "llm"})
"""Kinds of evaluation questions (a policy manifest's `evaluation.questions`) that no person asked: made from the
corpus's passages, or written by an LLM. A verdict measured on them does not vouch for the policy."""


class CheckQuestion(Protocol):
    """A question the check searches: its text, its kind, and whether returned documents answer it."""

    @property
    def question(self) -> str: ...

    @property
    def kind(self) -> str: ...

    def found(self, documents: Sequence[Document]) -> bool: ...


@dataclass(frozen=True)
class LabelledQuestion:
    """One of the operator's labelled questions: found by a passage holding a gold answer (GenAcc's span check)
    or by one of its labelled passages (`passage_ids`)."""

    question: str
    answers: tuple[str, ...] = ()
    passage_ids: tuple[str, ...] = ()
    kind: str = "labelled"

    def found(self, documents: Sequence[Document]) -> bool:
        ids = set(self.passage_ids)
        return any((ids and d.id in ids) or (self.answers and span_match(d.text, list(self.answers)))
                   for d in documents)


def _kinds(questions: Sequence[CheckQuestion]) -> dict[str, int]:
    """How many questions of each kind."""
    return dict(Counter(q.kind for q in questions))


def read_labelled(path: Path, limit: int | None = None) -> list[LabelledQuestion]:
    """The operator's labelled questions (`SEARCHER_CORPUS_CHECK_QA`), read as `plugsearch-train compact --qa`
    reads a question file (every bad row refused with its line: `ValueError`); yes/no questions left out (the
    span check cannot judge them); the first `limit`."""
    from plugsearch.common.qa import read_qa_file  # the one reader of a user's question files

    items = [q for q in read_qa_file(path) if q.passage_ids or not is_yes_no(q.golden_answers)]
    return [LabelledQuestion(q.question, tuple(q.golden_answers), tuple(q.passage_ids))
            for q in items[:limit]]


@dataclass
class CheckResult:
    """What the check measured and decided (`/version`'s `details.corpus_check.last`)."""

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
    """Per kind of question: the policy's and naive's answer recall."""
    kind: Kind = "pseudo"
    """What the questions were: made from the corpus (`pseudo`), the operator's labelled ones (`labelled`), or
    none asked here: the policy's own evaluation on this corpus (`policy evaluation`)."""
    rule: str = "first"
    """How the decision was reached: `first` (the first verdict of this index: the mean against `-margin`), or on a
    check after the corpus changed, `kept` (the new interval does not exclude the standing verdict's side, so it
    stands), `confirmed` (the new measurement says the same), `changed` (its interval excludes the old side)."""
    passages: int = 0
    """Passages served when it was measured."""
    changed_passages: int = 0
    """The retriever's count of passages put and deleted (since its base index) when it was measured."""
    measured: bool = True
    """Whether it rests on a measurement with an interval (not: too few questions, or the policy's own verdict)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


WHAT = {"pseudo": "pseudo-questions of this corpus", "labelled": "your labelled questions (SEARCHER_CORPUS_CHECK_QA)"}


async def check_policy(policy: ActingPolicy, params: SearchParams, retriever: RetrieverBackend,
                       questions: Sequence[CheckQuestion], *, margin: float = 0.0, kind: Kind = "pseudo"
                       ) -> CheckResult:
    """The policy (searching with `params`, mode s3) against naive BM25 top-`params.select_k` on `questions`:
    `policy` when its mean answer-recall difference is at least `-margin`, else `naive`."""
    t0 = time.perf_counter()
    if len(questions) < MIN_QUESTIONS:
        what = "pseudo-questions" if kind == "pseudo" else "labelled questions (SEARCHER_CORPUS_CHECK_QA)"
        why = ("could be made from the corpus (at least {} are needed to measure the policy): too small or too "
               "uniform to check" if kind == "pseudo" else "were given (at least {} are needed to measure the "
               "policy): too few to check").format(MIN_QUESTIONS)
        return CheckResult("naive", f"only {len(questions)} {what} {why}, naive BM25 top-k serves",
                           questions=len(questions),
                           margin=margin, seconds=time.perf_counter() - t0, kinds=_kinds(questions), kind=kind,
                           measured=False)
    k = params.select_k
    naive_docs = await retriever.retrieve([q.question for q in questions], k, "bm25")
    diffs, policy_hits, naive_hits, searches = [], 0, 0, 0
    per_kind: dict[str, list[float]] = {}
    for q, naive in zip(questions, naive_docs, strict=True):
        outcome = await run_search(q.question, params, policy=policy, retriever=retriever)
        hit_p = q.found(outcome.documents[:k])
        hit_n = q.found(naive[:k])
        policy_hits += hit_p
        naive_hits += hit_n
        searches += len(outcome.queries)
        diffs.append(float(hit_p) - float(hit_n))
        tally = per_kind.setdefault(q.kind, [0.0, 0.0, 0.0])
        tally[0] += 1
        tally[1] += hit_p
        tally[2] += hit_n
    n = len(questions)
    by_kind = {name: {"n": t[0], "policy": round(t[1] / t[0], 3), "naive": round(t[2] / t[0], 3)}
               for name, t in sorted(per_kind.items())}
    diff = sum(diffs) / n
    interval = bootstrap_interval(diffs)  # paired: the interval of the mean difference
    decision: Decision = "policy" if diff >= -margin else "naive"
    result = CheckResult(decision, "", questions=n, policy_recall=round(policy_hits / n, 4),
                         naive_recall=round(naive_hits / n, 4), difference=round(diff, 4), interval=interval,
                         margin=margin, searches_per_question=round(searches / n, 3),
                         seconds=round(time.perf_counter() - t0, 3), kinds=_kinds(questions), by_kind=by_kind,
                         kind=kind)
    result.reason = explain(result, k)
    return result


def _measured(result: CheckResult, k: int) -> str:
    n, lo, hi = result.questions, result.interval[0], result.interval[1]
    return (f"the policy found the answer of {round(result.policy_recall * n)} of {n} {WHAT.get(result.kind, result.kind)}, "
            f"naive BM25 top-{k} {round(result.naive_recall * n)} (difference {result.difference:+.3f}, 95% interval "
            f"[{lo:+.3f}, {hi:+.3f}])")


def explain(result: CheckResult, k: int | None = None, old: CheckResult | None = None) -> str:
    """The sentence `/version`, the log and a fallback response say for `result`."""
    k = k or 3
    said = _measured(result, k)
    serves = ("the policy serves" if result.decision == "policy" else
              f"naive BM25 top-{k} serves s3 searches (SEARCHER_CORPUS_CHECK=off serves the policy anyway)")
    if result.rule == "kept" and old is not None:
        return (f"{said} after {result.changed_passages - old.changed_passages} passages changed; its interval does "
                f"not exclude the standing verdict's side (the earlier difference {old.difference:+.3f}), so the "
                f"verdict stands: {serves}")
    if result.rule == "changed" and old is not None:
        return (f"{said} after {result.changed_passages - old.changed_passages} passages changed: clearly "
                f"{'below' if result.decision == 'naive' else 'not below'} naive by more than {result.margin:g} "
                f"(it was {old.difference:+.3f}), so the verdict changes: {serves}")
    if result.decision == "policy":
        return f"{said}: {serves}"
    return f"{said}: below naive by more than {result.margin:g}, so {serves}"


def settle(old: CheckResult | None, new: CheckResult, margin: float) -> tuple[Decision, str]:
    """The verdict after a new measurement, with hysteresis: (decision, rule). Without a measured standing verdict
    (`old` None, or it measured nothing) the new one decides (`first`: its mean against `-margin`). Otherwise the
    standing verdict is kept unless the new interval excludes its side: `policy` turns `naive` only when the
    new interval's upper bound is below `-margin`, `naive` turns `policy` only when its lower bound is at least
    `-margin`. A new measurement that measured nothing (too few questions) keeps a measured verdict."""
    if old is None or not old.measured:
        return new.decision, "first"
    if not new.measured:
        return old.decision, "kept"
    lo, hi = new.interval
    if old.decision == "policy":
        decision: Decision = "naive" if hi < -margin else "policy"
    else:
        decision = "policy" if lo >= -margin else "naive"
    if decision != old.decision:
        return decision, "changed"
    return decision, "confirmed" if new.decision == decision else "kept"


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
    if evaluation.get("questions") in MADE_UP:
        # trained and evaluated on questions made from the corpus or written by an LLM: the check's questions are
        # of the same kind, so they cannot vouch for it (on the development sets such policies passed them and lost
        # on real questions): not served unless the operator says so, or labelled questions show it
        return False
    verdict = evaluation.get("beats_naive")
    return verdict if isinstance(verdict, bool) else None


def evaluation_figures(manifest: Mapping[str, Any], key: str = "compact_rl", budget: int = 3) -> dict[str, Any]:
    """What a policy's own evaluation measured against naive BM25 (n, difference, interval), where its manifest
    records it (`evaluation.bench.all`), for `/version`."""
    evaluation = manifest.get("evaluation")
    bench = evaluation.get("bench") if isinstance(evaluation, Mapping) else None
    pooled = bench.get("all") if isinstance(bench, Mapping) else None
    block = pooled.get(f"budget{budget}", {}).get("answer_recall", {}) if isinstance(pooled, Mapping) else {}
    out: dict[str, Any] = {}
    diff, ci = block.get(f"{key}_minus_naive"), block.get(f"{key}_minus_naive_ci95")
    if isinstance(diff, int | float):
        out["difference"] = float(diff)
    if isinstance(ci, list) and len(ci) == 2:
        out["interval"] = [float(ci[0]), float(ci[1])]
    n = pooled.get("n") if isinstance(pooled, Mapping) else None
    if not isinstance(n, int) and isinstance(bench, Mapping):
        sets = bench.get("datasets")
        if isinstance(sets, Mapping):
            n = sum(int(d.get("n") or 0) for d in sets.values() if isinstance(d, Mapping)) or None
    if isinstance(n, int):
        out["questions"] = n
    for name in ("policy", "naive"):
        value = block.get(key if name == "policy" else "naive_bm25")
        if isinstance(value, int | float):
            out[f"{name}_recall"] = float(value)
    return out


def base_index(index_id: str, changes: Mapping[str, Any] | None) -> str:
    """The index a verdict belongs to while documents are put, deleted and compacted: the built indexes' identity
    (`changes.built_index_id`), or from an older retriever its index id without the change suffix (`<base>-c<seq>`)."""
    built = (changes or {}).get("built_index_id")
    if isinstance(built, str) and built:
        return built
    seq = (changes or {}).get("seq")
    suffix = f"-c{seq}" if isinstance(seq, int) and seq else None
    return index_id[:-len(suffix)] if suffix and index_id.endswith(suffix) else index_id


def changed_passages(changes: Mapping[str, Any] | None) -> int:
    """Passages put and deleted since the retriever's base index (its `/version` `changes.passages`; from an older
    retriever, the documents added, replaced and deleted)."""
    if not changes:
        return 0
    passages = changes.get("passages")
    if isinstance(passages, int):
        return passages
    return sum(int(changes.get(k) or 0) for k in ("added", "replaced", "deleted"))


GateKey = tuple[str, tuple[str, ...]]


@dataclass
class _Standing:
    result: CheckResult
    checked_at: float
    """When the last check of this key started (monotonic): re-checks are at least `min_interval_s` apart."""


class CorpusGate:
    """The check, once per served index and pool: `verdict(index_id, params, details)` is the standing result for
    that index and pool, and starts the check the first time it is asked; while that check runs, the last verdict
    (of the index this one replaced) stands, and before any verdict (None) the caller serves naive. A check that
    cannot run (the retriever cannot sample passages, a search fails) is retried after `retry_s`; meanwhile naive
    serves.

    Documents put and deleted while serving move the retriever's index identity (`<base>-c<seq>`) but not the
    index a verdict belongs to (`base_index`): the verdict stands until `recheck_share` of the passages it was
    measured on have changed (`changed_passages`, from the retriever's `/version`), then the check runs again, at
    most once per `min_interval_s`, and its result replaces the verdict only as `settle` allows.

    `labelled`: the operator's labelled questions; when given, every check searches them (kind `labelled`)
    instead of making pseudo-questions, and they take precedence over the policy's own evaluation."""

    def __init__(self, policy: ActingPolicy, retriever: RetrieverBackend, sample: Sampler, *, questions: int = 200,
                 margin: float = 0.0, seed: int = 0, manifest: Mapping[str, Any] | None = None,
                 retry_s: float = 30.0, recheck_share: float = 0.05, min_interval_s: float = 600.0,
                 labelled: Sequence[CheckQuestion] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.retriever = retriever
        self.sample = sample
        self.questions = questions
        self.margin = margin
        self.seed = seed
        self.manifest = manifest or {}
        self.retry_s = retry_s
        self.recheck_share = recheck_share
        self.min_interval_s = min_interval_s
        self.labelled = list(labelled) if labelled is not None else None
        self.clock = clock
        self.results: dict[GateKey, _Standing] = {}
        self._failed: dict[GateKey, tuple[float, str]] = {}
        self._running: dict[GateKey, asyncio.Task[None]] = {}
        self.last: CheckResult | None = None
        """The most recent verdict (what `/version` shows, and what serves while a new index is checked)."""
        self.checks = 0
        """Checks run (each search of the questions), first ones and re-checks."""
        self.rechecks = 0
        self._now: tuple[GateKey, int, int] | None = None
        """The key asked last, with the retriever's changed-passage count and served passages then."""

    @staticmethod
    def key(index_id: str, params: SearchParams, changes: Mapping[str, Any] | None = None) -> GateKey:
        return base_index(index_id, changes), tuple(params.pool_methods or [params.method or "bm25"])

    def verdict(self, index_id: str, params: SearchParams, details: Mapping[str, Any] | None = None
                ) -> CheckResult | None:
        """The standing verdict for the index the retriever serves (`details`: its `/version` details: the corpus's
        checksum, `changes`, `documents`), starting a check where none stands or the corpus has changed enough."""
        details = details or {}
        raw_changes = details.get("changes")
        changes = raw_changes if isinstance(raw_changes, Mapping) else None
        key = self.key(index_id, params, changes)
        changed, passages = changed_passages(changes), int(details.get("documents") or 0)
        self._now = (key, changed, passages)
        standing = self.results.get(key)
        if standing is not None:
            if self._due(standing, changed) and key not in self._running:
                self._start(key, params, (changed, passages), recheck=True)
            return standing.result
        if self.labelled is None:
            checksum = details.get("corpus_checksum")
            evaluated = evaluated_here(self.manifest, checksum if isinstance(checksum, str) else None)
            if evaluated is not None:
                self._settle(key, self._own_verdict(evaluated), started=self.clock())
                return self.last
        failed = self._failed.get(key)
        if key not in self._running and (failed is None or self.clock() - failed[0] >= self.retry_s):
            self._start(key, params, (changed, passages), recheck=False)
        # while the new index (the dense index loaded, another corpus) is checked, the last verdict stands
        return self.last

    def _own_verdict(self, evaluated: bool) -> CheckResult:
        pseudo = (self.manifest.get("evaluation") or {}).get("questions") in MADE_UP
        reason = ("the policy was trained and evaluated on this corpus: its evaluation on held-back labelled "
                  "questions says it beats naive top-k" if evaluated else
                  ("the policy was trained and evaluated on questions made from this corpus (or written by an LLM) "
                   "only, which do not show how it does on real questions (pseudo-question checks cannot either): "
                   if pseudo else "the policy's own evaluation on this corpus says it does not beat naive top-k: ") +
                  "naive BM25 top-k serves s3 searches (SEARCHER_CORPUS_CHECK=off serves the policy anyway; "
                  "SEARCHER_CORPUS_CHECK_QA=FILE measures it on your labelled questions)")
        figures = {} if pseudo else evaluation_figures(self.manifest)
        return CheckResult("policy" if evaluated else "naive", reason, kind="policy evaluation", measured=False,
                           **figures)

    def _due(self, standing: _Standing, changed: int) -> bool:
        """Whether the corpus has moved enough since `standing` was measured, and the last check is long enough
        ago, for a re-check."""
        result = standing.result
        if result.kind == "policy evaluation":
            return False  # the policy's own verdict on its corpus: drift is `corpus_drift`'s advice to retrain
        share = (changed - result.changed_passages) / max(1, result.passages)
        return share >= self.recheck_share and self.clock() - standing.checked_at >= self.min_interval_s

    def drift(self) -> dict[str, Any] | None:
        """How far the served corpus moved since the standing verdict of the index asked last (`/version`)."""
        if self._now is None or self._now[0] not in self.results:
            return None
        key, changed, _ = self._now
        standing = self.results[key]
        moved = max(0, changed - standing.result.changed_passages)
        wait = max(0.0, self.min_interval_s - (self.clock() - standing.checked_at))
        return {"passages_changed": moved, "share": round(moved / max(1, standing.result.passages), 4),
                "recheck_share": self.recheck_share, "min_interval_s": self.min_interval_s,
                "next_check_allowed_in_s": round(wait, 1)}

    def _start(self, key: GateKey, params: SearchParams, at: tuple[int, int], *, recheck: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._run(key, params, at, recheck=recheck))
        self._running[key] = task
        task.add_done_callback(lambda _: self._running.pop(key, None))

    @property
    def ready(self) -> bool:
        """Whether searches get a verdict (a check ended, or could not run and naive serves): readiness waits."""
        return self.last is not None or bool(self._failed)

    def pending_reason(self, index_id: str, params: SearchParams, details: Mapping[str, Any] | None = None) -> str:
        raw = (details or {}).get("changes")
        failed = self._failed.get(self.key(index_id, params, raw if isinstance(raw, Mapping) else None))
        if failed is not None:
            return f"the corpus check could not run ({failed[1]}); it is retried; naive BM25 top-k serves meanwhile"
        return "the corpus check of this index is running (seconds); naive BM25 top-k serves meanwhile"

    def _settle(self, key: GateKey, result: CheckResult, *, started: float) -> None:
        self.results[key] = _Standing(result, started)
        self._failed.pop(key, None)
        self.last = result
        log = logger.info if result.decision == "policy" else logger.warning
        log("corpus check of index %s (pool %s, %s): %s", key[0], "+".join(key[1]), result.kind, result.reason)

    async def _questions(self) -> list[CheckQuestion]:
        if self.labelled is not None:
            return list(self.labelled)
        passages = await self.sample(self.questions * 2, self.seed)
        return list(await check_questions(passages, self.retriever, self.questions, seed=self.seed))

    async def _run(self, key: GateKey, params: SearchParams, at: tuple[int, int], *, recheck: bool) -> None:
        """One check of `key`'s index; `at`: the retriever's changed-passage count and served passages when it
        was asked for."""
        started = self.clock()
        changed, passages = at
        old = self.results[key].result if recheck and key in self.results else None
        if old is not None:  # the next re-check waits `min_interval_s` from this one's start, whatever its outcome
            self.results[key].checked_at = started
        try:
            t0 = time.perf_counter()
            questions = await self._questions()
            result = await check_policy(self.policy, params.model_copy(update={"timeout_s": None}), self.retriever,
                                        questions, margin=self.margin,
                                        kind="labelled" if self.labelled is not None else "pseudo")
            result.seconds = round(time.perf_counter() - t0, 3)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the check must never take the service down; retried later
            message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
            logger.warning("corpus check of index %s could not run: %s (retried %s)", key[0], message,
                           "after the next interval" if old is not None else f"in {self.retry_s:.0f} s")
            if old is None:
                self._failed[key] = (self.clock(), str(message))
            return
        self.checks += 1
        self.rechecks += old is not None
        result.changed_passages, result.passages = changed, passages
        if old is not None and not result.measured:  # too few questions this time: the measured verdict stands
            logger.warning("corpus check of index %s after the corpus changed measured nothing (%s); the verdict "
                           "stands", key[0], result.reason)
            return
        result.decision, result.rule = settle(old, result, self.margin)
        result.reason = explain(result, params.select_k, old) if result.measured else result.reason
        self._settle(key, result, started=started)

    def describe(self) -> dict[str, Any]:
        """What `/version` shows: the latest verdict (its kind of questions, n, interval, how it was reached), the
        checks run, how far the corpus moved since, and whether a check is running."""
        return {"state": "running" if self._running else ("done" if self.last is not None else "not run"),
                "questions": "labelled" if self.labelled is not None else "pseudo",
                "checks": self.checks, "rechecks": self.rechecks, "since_verdict": self.drift(),
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
