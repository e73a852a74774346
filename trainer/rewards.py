"""Rewards of searcher trajectories through the services, a whole batch concurrently.

- gbr (s3): GenAcc(generator(q, searcher's documents)) - GenAcc(generator(q, naive top-k)), the baseline
  from the `BaselineStore` (never replaced by a no-retrieval answer);
- genacc / em: of the frozen generator's answer; gbr_genacc: GBR + GenAcc;
- qagent (QAgent stage 2): EM + 0.5 x hit (a gold answer in the documents the trajectory retrieved);
- recall: GBR without an LLM: hit(searcher's documents) - hit(naive top-n), n = the number of documents the
  searcher returned, hit = GenAcc's span check; equal budgets, so more documents earn nothing by
  themselves. Its breakdown's `genacc` / `baseline_genacc` are those two hits;
- format (Search-R1): share of the policy's actions that parsed, weighted by lambda.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.answers import span_match
from services.common.schemas.base import Document
from services.common.schemas.retriever import Method
from trainer.baseline import BaselineRecord, BaselineStore, baselines_for
from trainer.data import QAItem
from trainer.settings import RewardKind
from trainer.upstreams import Answered, QAServices

QAGENT_HIT_WEIGHT = 0.5
NAIVE_DEPTH = 16
"""recall: naive top-n is cut from one retrieval of this depth per question (deeper when n is larger)."""


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
    def __init__(self, services: QAServices, *, kind: RewardKind = "gbr", baselines: BaselineStore | None = None,
                 format_lambda: float = 0.0, method: Method | None = None) -> None:
        if kind in ("gbr", "gbr_genacc") and baselines is None:
            raise ValueError(f"reward {kind} needs a BaselineStore")
        self.services = services
        self.kind = kind
        self.baselines = baselines
        self.format_lambda = format_lambda
        self.method = method
        self._naive: dict[str, tuple[int, list[Document]]] = {}
        """question -> (depth retrieved, naive ranking)"""

    async def naive_top(self, question: str, n: int) -> list[Document]:
        """Naive top-n of the question (one retrieval per question, again only when a deeper n is asked)."""
        depth, docs = self._naive.get(question, (0, []))
        if n > depth:
            depth = max(n, NAIVE_DEPTH)
            docs = (await self.services.retrieve([question], depth, self.method))[0]
            self._naive[question] = (depth, docs)
        return docs[:n]

    async def _score_recall(self, trajectories: Sequence[Trajectory]) -> list[RewardBreakdown]:
        naive = await asyncio.gather(*(self.naive_top(t.item.question, len(t.documents)) for t in trajectories))
        out = []
        for t, base in zip(trajectories, naive, strict=True):
            found = documents_hit(t.documents, t.item.golden_answers)
            baseline = documents_hit(base, t.item.golden_answers) if t.documents else 0.0
            out.append(self._breakdown(t, found - baseline, genacc=found, em=0.0, f1=0.0, answer="",
                                       baseline_genacc=baseline, hit=found))
        return out

    def _breakdown(self, t: Trajectory, reward: float, **parts: Any) -> RewardBreakdown:
        fmt = format_score(t.valid_actions, t.invalid_actions)
        total = reward + self.format_lambda * fmt
        return RewardBreakdown(reward=reward, format_score=fmt, total=total, **parts)

    async def score(self, trajectories: Sequence[Trajectory]) -> list[RewardBreakdown]:
        """Every trajectory's answer + judgement and every needed baseline, all concurrently."""
        if not trajectories:
            return []
        if self.kind == "recall":
            return await self._score_recall(trajectories)
        answers_task = self.services.answer_and_judge(
            [(t.item.question, t.documents, t.item.golden_answers) for t in trajectories])
        if self.baselines is not None and self.kind in ("gbr", "gbr_genacc"):
            answered, baselines = await asyncio.gather(
                answers_task, baselines_for(self.services, self.baselines, [t.item for t in trajectories]))
        else:
            answered, baselines = await answers_task, {}
        out: list[RewardBreakdown] = []
        for t, a in zip(trajectories, answered, strict=True):
            baseline = baselines.get(t.item.id)
            hit = trajectory_hit(t)
            out.append(self._breakdown(t, combine(self.kind, a, baseline, hit), genacc=a.genacc, em=a.em,
                                       f1=a.f1, answer=a.answer, hit=hit,
                                       baseline_genacc=baseline.genacc if baseline is not None else None))
        return out
