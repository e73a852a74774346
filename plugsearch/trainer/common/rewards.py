"""The one reward computer of searcher trajectories (every trainer: the compact policy's REINFORCE, TRL's
GRPO, veRL), a whole batch concurrently.

- gbr (s3): GenAcc(generator(q, searcher's documents)) - GenAcc(generator(q, naive documents)), the frozen
  generator and the GenAcc judge through the services; the naive baseline's GenAcc is stored
  (`BaselineStore`, computed once per question and budget, never replaced by a no-retrieval answer);
- genacc / em: of the frozen generator's answer; gbr_genacc: GBR + GenAcc;
- qagent (QAgent stage 2): EM + 0.5 x hit (a gold answer in the documents the trajectory retrieved);
- recall: GBR without an LLM: hit(searcher's documents) - hit(naive documents), hit = GenAcc's span check.
  Its breakdown's `genacc` / `baseline_genacc` are those two hits;
- format (Search-R1): share of the policy's actions that parsed, weighted by lambda.

The naive documents of GBR (either form) are one of two named baselines (`Baseline`): `top_k`, naive
top-k at a fixed k (s3's: k = 3, the `BaselineStore`'s; `gbr`'s default), or `same_n`, naive top-n at the n
documents the trajectory returned (equal budgets: more documents earn nothing by themselves; `recall`'s
default). A trajectory that returned nothing scores `recall` 0 (never negative) and, for `gbr` with `same_n`,
is compared with naive top-1 (the baseline is never a no-retrieval answer).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from plugsearch.common.answers import span_match
from plugsearch.common.qa import QAItem
from plugsearch.common.qa import found as found_in
from plugsearch.common.schemas.base import Document
from plugsearch.common.schemas.retriever import Method
from plugsearch.searcher.env import RetrieverBackend
from plugsearch.trainer.common.baseline import BaselineRecord, BaselineStore, baselines_for
from plugsearch.trainer.common.settings import RewardKind
from plugsearch.trainer.common.upstreams import Answered, QAServices

QAGENT_HIT_WEIGHT = 0.5
NAIVE_DEPTH = 16
"""Naive top-n is cut from one retrieval of this depth per question (deeper when n is larger)."""

Baseline = Literal["top_k", "same_n"]
"""GBR's naive documents: `top_k` (naive top-k, k fixed: s3's 3) or `same_n` (naive top-n at the n documents
the trajectory returned)."""
BASELINES: tuple[Baseline, ...] = ("top_k", "same_n")
LLM_KINDS = frozenset({"gbr", "genacc", "em", "qagent", "gbr_genacc"})
"""Reward kinds that answer with the frozen generator and judge through the services."""


@dataclass
class Trajectory:
    """What a reward needs from one rollout of the search loop."""

    item: QAItem
    documents: list[Document]
    """The documents handed to the frozen generator (s3: selected; qagent: union of retrieved)."""
    valid_actions: int = 0
    invalid_actions: int = 0
    retrieved: list[Document] = field(default_factory=list)
    """Every document the trajectory saw (for QAgent's hit); defaults to `documents`."""
    retriever: RetrieverBackend | None = None
    """The retriever of the corpus the question was asked over where it is not the reward's (the recall reward's
    naive documents come from it)."""


@dataclass
class RewardBreakdown:
    reward: float
    """The selected reward (without the format term)."""
    format_score: float
    total: float
    """reward + lambda x format_score: what the RL update optimises."""
    genacc: float
    em: float
    f1: float
    answer: str
    baseline_genacc: float | None = None
    hit: float | None = None


def format_score(valid_actions: int, invalid_actions: int) -> float:
    """Share of the policy's actions that were well-formed (0 when it never acted)."""
    total = valid_actions + invalid_actions
    return valid_actions / total if total else 0.0


def trajectory_hit(trajectory: Trajectory) -> float:
    docs = trajectory.retrieved or trajectory.documents
    text = "\n".join(f"{d.title} {d.text}" for d in docs)
    return float(bool(text) and span_match(text, trajectory.item.golden_answers))


def documents_hit(documents: Sequence[Document], golden_answers: Sequence[str]) -> float:
    """1.0 when some document's text contains a gold answer (GenAcc's span check), else 0.0."""
    return float(any(span_match(d.text, golden_answers) for d in documents))


def combine(kind: RewardKind, answered: Answered, baseline: BaselineRecord | None, hit: float) -> float:
    if kind == "genacc":
        return answered.genacc
    if kind == "em":
        return answered.em
    if kind == "qagent":
        return answered.em + QAGENT_HIT_WEIGHT * hit
    if baseline is None:
        raise ValueError(f"reward {kind} needs a naive-RAG baseline")
    gbr = answered.genacc - baseline.genacc
    return gbr + answered.genacc if kind == "gbr_genacc" else gbr


class RewardComputer:
    """Rewards of a batch of trajectories. `services` answer and judge (every kind but `recall`) and, unless
    `retriever` is given, retrieve the naive documents; `baselines` stores the naive GenAcc of GBR (its
    config's k is `top_k`'s; `same_n` keeps one store per n beside it). `seconds` sums what scoring spent in
    the generator and judge (and in computing missing baselines), for the trainers' time reports."""

    def __init__(self, services: QAServices | None, *, kind: RewardKind = "gbr", baseline: Baseline | None = None,
                 baselines: BaselineStore | None = None, format_lambda: float = 0.0, method: Method | None = None,
                 retriever: RetrieverBackend | None = None) -> None:
        if kind in ("gbr", "gbr_genacc") and baselines is None:
            raise ValueError(f"reward {kind} needs a BaselineStore")
        if kind in LLM_KINDS and services is None:
            raise ValueError(f"reward {kind} answers through the generator and judge services: give them")
        if services is None and retriever is None:
            raise ValueError("the reward needs a retriever for its naive documents")
        baseline = baseline or ("same_n" if kind == "recall" else "top_k")
        if baseline not in BASELINES:
            raise ValueError(f"baseline {baseline!r}: one of {', '.join(BASELINES)}")
        self.services = services
        self.own_retriever = retriever
        """Where naive documents come from when not from `services` (e.g. the in-process indexes)."""
        self.retriever: RetrieverBackend | QAServices = retriever if retriever is not None else services  # type: ignore[assignment]
        self.kind = kind
        self.baseline: Baseline = baseline
        self.baselines = baselines
        self.format_lambda = format_lambda
        self.method = method
        self.service_seconds = 0.0
        """Wall seconds spent waiting on the generator and judge (answers and missing baselines)."""
        self._naive: dict[tuple[int, str], tuple[int, list[Document]]] = {}
        """(retriever, question) -> (depth retrieved, naive ranking)"""

    @property
    def top_k(self) -> int:
        """`top_k`'s k: the store's, else s3's 3."""
        return self.baselines.config.k if self.baselines is not None else 3

    def budget(self, trajectory: Trajectory) -> int:
        """How many naive documents the trajectory is compared with (`same_n` and nothing returned: 0 for
        `recall`, 1 for the LLM kinds)."""
        if self.baseline == "top_k":
            return self.top_k
        return len(trajectory.documents) or (0 if self.kind == "recall" else 1)

    async def naive_top(self, question: str, n: int, retriever: RetrieverBackend | None = None) -> list[Document]:
        """Naive top-n of the question (one retrieval per question, again only when a deeper n is asked), from
        `retriever` where given, else the reward's."""
        source = retriever if retriever is not None else self.retriever
        key = (id(source), question)
        depth, docs = self._naive.get(key, (0, []))
        if n > depth:
            depth = max(n, NAIVE_DEPTH)
            docs = (await source.retrieve([question], depth, self.method))[0]
            self._naive[key] = (depth, docs)
        return docs[:n]

    async def _score_recall(self, trajectories: Sequence[Trajectory]) -> list[RewardBreakdown]:
        naive = await asyncio.gather(*(self.naive_top(t.item.question, self.budget(t), t.retriever)
                                       for t in trajectories))
        out = []
        for t, base in zip(trajectories, naive, strict=True):
            found = float(found_in(t.documents, t.item))
            baseline = float(found_in(base, t.item))
            out.append(self._breakdown(t, found - baseline, genacc=found, em=0.0, f1=0.0, answer="",
                                       baseline_genacc=baseline, hit=found))
        return out

    def _breakdown(self, t: Trajectory, reward: float, **parts: Any) -> RewardBreakdown:
        fmt = format_score(t.valid_actions, t.invalid_actions)
        total = reward + self.format_lambda * fmt
        return RewardBreakdown(reward=reward, format_score=fmt, total=total, **parts)

    async def _baselines(self, services: QAServices, trajectories: Sequence[Trajectory]
                         ) -> list[BaselineRecord | None]:
        """Each trajectory's naive-RAG baseline (GBR): missing ones computed once per question and budget,
        the budgets concurrently."""
        store = self.baselines
        if store is None:
            return [None] * len(trajectories)
        budgets = [self.budget(t) for t in trajectories]
        by_budget: dict[int, dict[str, QAItem]] = {}
        for t, n in zip(trajectories, budgets, strict=True):
            by_budget.setdefault(n, {})[t.item.id] = t.item
        found = await asyncio.gather(*(baselines_for(services, store.with_k(n), list(items.values()),
                                                     retriever=self.own_retriever)
                                       for n, items in by_budget.items()))
        records = dict(zip(by_budget, found, strict=True))
        return [records[n].get(t.item.id) for t, n in zip(trajectories, budgets, strict=True)]

    async def score(self, trajectories: Sequence[Trajectory]) -> list[RewardBreakdown]:
        """Every trajectory's answer + judgement and every needed baseline, all concurrently."""
        if not trajectories:
            return []
        if self.kind == "recall":
            return await self._score_recall(trajectories)
        if any(t.retriever is not None for t in trajectories):
            raise ValueError(f"reward {self.kind}: a trajectory over another corpus (its own retriever) is scored by "
                             "the recall reward only")
        services = self.services
        if services is None:  # refused in __init__
            raise ValueError(f"reward {self.kind} needs the services")
        t0 = time.perf_counter()
        answers_task = services.answer_and_judge(
            [(t.item.question, t.documents, t.item.golden_answers) for t in trajectories])
        if self.kind in ("gbr", "gbr_genacc"):
            answered, baselines = await asyncio.gather(answers_task, self._baselines(services, trajectories))
        else:
            answered, baselines = await answers_task, [None] * len(trajectories)
        self.service_seconds += time.perf_counter() - t0
        out: list[RewardBreakdown] = []
        for t, a, baseline in zip(trajectories, answered, baselines, strict=True):
            hit = trajectory_hit(t)
            out.append(self._breakdown(t, combine(self.kind, a, baseline, hit), genacc=a.genacc, em=a.em,
                                       f1=a.f1, answer=a.answer, hit=hit,
                                       baseline_genacc=baseline.genacc if baseline is not None else None))
        return out

    async def aclose(self) -> None:
        """Close the services' clients and the baseline store (when the computer was given them to own)."""
        close = getattr(self.services, "aclose", None)
        if close is not None:
            await close()
        if self.baselines is not None:
            await self.baselines.aclose()
